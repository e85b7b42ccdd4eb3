"""ds_packdpo: padding-free, rank-balanced DPO training on DeepSpeed ZeRO-3."""

__version__ = "0.1.0"
