"""Cost planning of training runs: estimate before launch (``train plan``), estimate vs actual (``train report``)."""
