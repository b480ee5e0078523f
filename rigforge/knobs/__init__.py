"""Every role's knobs (host-data keys), its defaults and checks: one module per role of roles/."""
