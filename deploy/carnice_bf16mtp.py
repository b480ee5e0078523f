"""Provision rigs to serve carnice-bf16mtp. Hermes agentic fine-tune (Carnice tool specialization).

Carnice-V2-27B (Hermes-style fine-tune) AutoRound INT4 + BF16 MTP overlay;
same shape as dual.yml but hermes tool parser + template override

    pyinfra inventories/home.py deploy/carnice_bf16mtp.py
"""

from roles.entry import provision

provision("carnice-bf16mtp")
