"""What an expert parameter's summed gradient is divided by: the whole data axis, not its group.

Every data rank's loss is the mean over its own samples, and one device's gradient is the mean of
the ranks' gradients: a parameter every data rank holds is summed over the ``dp`` ranks and divided
by ``dp``. An expert parameter is held by the ``dp / E`` ranks of its expert-data group only, but
the gradient its owner computes already sums the contributions of the ``E`` ranks of its expert
group (their tokens reach it by all-to-all, and their gradients come back the same way). Summed
over the expert-data group it holds every data rank's contribution once, so it too is divided by
``dp``; dividing by the group's own size, ``dp / E``, as a plain average over that group would,
makes it ``E`` times too large. FSDP2 (its gradient divide factor) and the bucketed reducer apply
this one rule (Megatron-Core and torchtitan scale expert gradients the same way).
"""

from __future__ import annotations


def expert_gradient_divisor(data_parallel_size: int) -> int:
    """What the sum of an expert parameter's gradients over its expert-data group is divided by
    (``data_parallel_size``: every data rank's samples counted once; see the module)."""
    return data_parallel_size
