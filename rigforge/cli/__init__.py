"""The commands: `rigforge` (main.py) and its views: render, lock, status, verify, bench, rollout, images."""
