"""Grids of training runs (``nobubble sweep``): the grid file, the plan, the processes."""
