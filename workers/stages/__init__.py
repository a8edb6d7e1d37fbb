"""The pipeline stages, in the order a sample passes them.

feeder (``feeder``) → rollout (``rollout``, ``episode``, ``gate``) → filter (``filter``,
``advantages``) → packer (``packer``, ``packing``). ``sample_filters`` is run by two stages: the
filter (pre-batch) and the packer (post-batch). No stage imports another; what they share lives
in ``bus/``.
"""
