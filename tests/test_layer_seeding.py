"""Layer-seeded dropout (:mod:`lightning_pipe.execution.seeding`), without processes: a layer's
masks follow from its seed alone, so splitting the layers into stages anywhere draws the same
masks; recomputation (torch's checkpoint, and the zero-bubble replay) draws them again; the
program's own random stream is untouched."""

from __future__ import annotations

import torch
from torch import nn

from lightning_pipe.execution.layers import apply_layers
from lightning_pipe.execution.recompute import Replay, run_recomputed
from lightning_pipe.execution.seeding import layer_seed


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5)) for _ in range(4)]


def _x() -> torch.Tensor:
    return torch.randn(3, 5, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)


def _seeds(batch: int, microbatch: int) -> list[int]:
    return [layer_seed(7, batch, microbatch, k) for k in range(4)]


def test_any_split_into_stages_draws_the_same_masks() -> None:
    layers, x = _layers(), _x()
    whole = apply_layers(layers, x, seeds=_seeds(0, 0))
    seeds = _seeds(0, 0)
    for cut in (1, 2, 3):
        first = apply_layers(layers[:cut], x, 0, seeds[:cut])
        torch.testing.assert_close(apply_layers(layers[cut:], first, 1, seeds[cut:]), whole, atol=0, rtol=0)
    # Other batches and micro-batches draw other masks.
    assert not torch.equal(apply_layers(layers, x, seeds=_seeds(1, 0)), whole)
    assert not torch.equal(apply_layers(layers, x, seeds=_seeds(0, 1)), whole)


def test_the_programs_own_random_stream_is_untouched() -> None:
    layers, x = _layers(), _x()
    torch.manual_seed(11)
    expected = torch.rand(4)
    torch.manual_seed(11)
    apply_layers(layers, x, seeds=_seeds(0, 0))
    torch.testing.assert_close(torch.rand(4), expected, atol=0, rtol=0)
    # Without seeds, the layers draw from it (so the seeds are what made the difference).
    torch.manual_seed(11)
    apply_layers(layers, x)
    assert not torch.equal(torch.rand(4), expected)


def test_recomputation_draws_the_same_masks() -> None:
    layers, seeds = _layers(), _seeds(2, 1)

    def grads(run: str) -> list[torch.Tensor]:
        for layer in layers:
            layer.zero_grad()
        x = _x()
        torch.manual_seed(5)  # the stream a recomputation would otherwise replay or not
        if run == "plain":
            out = apply_layers(layers, x, 0, seeds)
        elif run == "checkpoint":
            out = run_recomputed(layers, x, 0, seeds)
            torch.rand(100)  # draws between forward and backward change nothing
        else:
            replay = Replay.capture(x, torch.device("cpu"), seeds)
            apply_layers(layers, x, 0, seeds)
            torch.rand(100)
            out = replay.run(layers, 0)
        out.square().sum().backward()
        assert x.grad is not None
        return [x.grad, *(p.grad for layer in layers for p in layer.parameters())]

    plain = grads("plain")
    for run in ("checkpoint", "replay"):
        for got, want in zip(grads(run), plain, strict=True):
            torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_a_sequence_parts_dropout_equals_nn_dropout_and_saves_booleans() -> None:
    """SequenceDropout's product: each rank's part of the whole sequence's mask, applied to its part,
    concatenated, is ``nn.Dropout`` on the whole sequence, bit for bit, forward and backward; what
    it saves for backward is a boolean mask (what ``nn.Dropout`` keeps), not a float copy."""
    from lightning_pipe.tensor_parallel.dropout import _Masked

    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        for p in (0.1, 0.3):
            x = torch.randn(2, 8, 5, dtype=dtype, requires_grad=True)
            grad = torch.randn(2, 8, 5, dtype=dtype)
            torch.manual_seed(3)
            expected = nn.functional.dropout(x, p, True)
            expected.backward(grad)
            expected_grad, x.grad = x.grad, None
            torch.manual_seed(3)
            scale = nn.functional.dropout(torch.ones_like(x), p, True)
            factor = torch.ones((), dtype=dtype).div_(1.0 - p).item()
            saved: list[torch.Tensor] = []

            def keep(t: torch.Tensor, saved: list[torch.Tensor] = saved) -> torch.Tensor:
                saved.append(t)
                return t

            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                parts = [
                    _Masked.apply(x[:, 4 * r : 4 * r + 4], scale[:, 4 * r : 4 * r + 4], factor)
                    for r in (0, 1)
                ]
            got = torch.cat(parts, dim=1)
            got.backward(grad)
            assert torch.equal(got, expected) and torch.equal(x.grad, expected_grad), (dtype, p)
            assert [t.dtype for t in saved] == [torch.bool, torch.bool]
