"""The observed state and the verdict: the facts read on a rig (facts/, probe.py the one batched read),
the hosts read for the commands (hosts.py, inventory.py), and what differs from the plan (verdict.py: one
function per resource; drift.py: the checks status and verify print)."""
