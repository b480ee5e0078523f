"""The desired state: the variants (catalog, the recipe registry's adapter), the settings as types (knobs/),
the lock, the rendered files and the plan of each rig (fleet.py)."""
