"""Reports: learning curves of training runs (``curves.py``)."""
