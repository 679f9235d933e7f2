"""The fault campaign: short pipeline runs under torchrun, each hit by a random fault at a random
moment, resumed with ``--auto-resume`` and compared with an uninterrupted twin.

    python experiments/fault_campaign.py --runs 50 --seed 0 --out runs/faults

- :mod:`~nobubble.faults.draw`: what each run is (a layout and a fault), drawn from the seed;
- :mod:`~nobubble.faults.inject`: how a fault is done to a running launch or its folder;
- :mod:`~nobubble.faults.compare`: what a resumed run lost against its twin;
- :mod:`~nobubble.faults.summary`: the counts, campaign.json and campaign.md;
- :mod:`~nobubble.faults.campaign`: the runs themselves, and the command line.

docs/reliability.md ("The fault campaign") says what it measures.
"""
