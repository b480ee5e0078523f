"""Load the images `rigforge images save DIR` kept onto each rig at their locked digests (roles/images.py).

rigforge images load DIR INVENTORY   (runs: pyinfra -y INVENTORY deploy/images_load.py --data rigforge_images_dir=DIR)
"""

from roles import site

site.load_saved_images()
