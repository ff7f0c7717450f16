"""The experiments behind the docs' figures, each run by a ``make`` target (the figure's command in the docs):

- ``rack_average_cost.py`` (``make bench-rack-cost``): one rack's average through Horovod process sets
  (the build's concurrent sets on and off) and through ``torch.distributed`` subgroups, side by side;
- ``long_steps.py`` (``make bench-long-steps``): the longest single step of DS-Sync's runs through a real
  launcher against the median of its averaging steps;
- ``parity.py`` (``make bench-parity``): accuracy at a fixed epoch budget against Horovod's optimizer, paired
  over seeds;
- ``sparse_bench.py`` (``make bench-sparse``): sparse against dense averaging of embedding tables;
- ``loopback_bench.py`` (``make bench-loopback``): the per-step cost of each launcher on one machine;
- ``compare.py``: the examples' JSON results side by side (``make demo``).
"""
