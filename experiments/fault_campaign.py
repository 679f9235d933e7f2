"""The fault campaign (docs/reliability.md, "The fault campaign"): nobubble.faults.campaign.

python experiments/fault_campaign.py --runs 50 --seed 0 --out runs/faults
"""

from nobubble.faults.campaign import main

if __name__ == "__main__":
    raise SystemExit(main())
