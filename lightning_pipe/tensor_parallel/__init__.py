"""Tensor parallelism (Megatron-LM, Shoeybi et al., 2019, arXiv:1909.08053): layers whose weights
are split across the ranks of a tensor-parallel group, the four communication regions they are
built from, a vocabulary-parallel cross entropy, and a plan that shards a plain model."""
