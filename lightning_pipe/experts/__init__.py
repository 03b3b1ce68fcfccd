"""Expert parallelism: the experts of each mixture-of-experts layer split over an expert axis.

See :mod:`lightning_pipe.mesh` for where the expert axis sits (it borrows from the data axis) and
:mod:`.shard` for how a parameter says which experts it holds.
"""

from lightning_pipe.experts.reduction import expert_gradient_divisor
from lightning_pipe.experts.shard import ExpertShard, expert_shard, mark_expert_shard

__all__ = ["ExpertShard", "expert_gradient_divisor", "expert_shard", "mark_expert_shard"]
