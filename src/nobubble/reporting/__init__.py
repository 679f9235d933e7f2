"""Tables and plots from run folders (``nobubble report``)."""
