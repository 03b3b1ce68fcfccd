"""What splitting a backward into I (input gradient) and W (weight gradient) costs.

Zero-bubble schedules run each stage's backward as two passes
(:mod:`lightning_pipe.execution.split_backward`); this measures their sum against one ordinary
backward of the same graph, in one process, one thread, on stacks of
``nn.TransformerEncoderLayer`` (no dropout, batch first). For each stack an ordinary backward and
an I + W are timed alternately (the order flips every round) on fresh forwards, the first rounds
are dropped and each is summarised by its median. ``ratio``: median I + W over median ordinary;
``I_ms`` and ``W_ms`` are the two halves; ``owners`` the nodes where weights leave the input path,
``ruled`` those whose W runs through a weight-gradient rule (:mod:`.weight_rules`, the one-call W)
rather than a backward call of its own. Before timing, the I + W gradients are checked against the
ordinary backward's (``max_abs_diff``: over every parameter and the input; expected 0.0).

``--profile`` adds where the time goes, each part timed on its own fresh forward (so they need
not add up exactly) and given as a fraction of the ordinary backward: ``I_engine``, autograd's
input-only backward (the I pass without its analysis); ``analysis``, the I pass's graph walk and
owner sweep; ``W_rules``, the rules' Python and the weight-side kernels they run; ``W_engine``, the
one autograd call from the rules' edges.

Run: ``python benchmarks/split_backward.py`` (table) or ``--json``; ``--stacks 12x64x8x32`` picks
stacks (layers x width x batch x tokens); ``--autocast`` runs the forward under bfloat16 autocast.
Target: ratio <= 1.10.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from _launch import emit_json, print_table, warn_if_busy
from torch import nn

from lightning_pipe.execution.split_backward import WeightGradients, backward_input
from lightning_pipe.execution.weight_rules import has_rule

TARGET = 1.10
STACKS = ("4x256x8x128", "12x256x8x128", "4x64x8x32", "12x64x8x32", "24x64x8x32")


def stack(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    heads = max(1, width // 64) if width >= 64 else 2
    return nn.Sequential(
        *[
            nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
            for _ in range(layers)
        ]
    )


def _clear(module: nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


def _count_owners(work: WeightGradients) -> tuple[int, int]:
    """(owners, owners whose node has a weight-gradient rule) of a W pass."""
    return len(work.owners), sum(has_rule(owner.node) for owner in work.owners)


def measure(spec: str, rounds: int, autocast: bool) -> dict[str, object]:
    layers, width, batch, tokens = (int(v) for v in spec.split("x"))
    module = stack(layers, width)
    x0, g = torch.randn(batch, tokens, width), torch.randn(batch, tokens, width)
    context: Callable[[], object] = (
        (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else (lambda: torch.enable_grad())
    )

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        x = x0.clone().requires_grad_(True)
        with context():  # type: ignore[attr-defined]
            y = module(x)
        return x, y

    # Correctness first: the split must give exactly one ordinary backward's gradients.
    _clear(module)
    x, y = forward()
    y.backward(g.to(y.dtype))
    reference = [p.grad.clone() for p in module.parameters()] + [x.grad.clone()]  # type: ignore[union-attr]
    _clear(module)
    x, y = forward()
    work = backward_input([y], [g.to(y.dtype)], [x])
    owners, ruled = _count_owners(work)
    work.run()
    ours = [p.grad for p in module.parameters()] + [x.grad]
    diff = max((a - b).abs().max().item() for a, b in zip(ours, reference, strict=True))  # type: ignore[operator]

    times: dict[str, list[float]] = {"ordinary": [], "split": [], "I": [], "W": []}
    for k in range(rounds):
        order = ("ordinary", "split") if k % 2 == 0 else ("split", "ordinary")
        for name in order:
            _clear(module)
            x, y = forward()
            gy = g.to(y.dtype)
            start = time.perf_counter()
            if name == "ordinary":
                torch.autograd.backward([y], [gy])
                times["ordinary"].append(time.perf_counter() - start)
                continue
            work = backward_input([y], [gy], [x])
            middle = time.perf_counter()
            work.run()
            end = time.perf_counter()
            times["split"].append(end - start)
            times["I"].append(middle - start)
            times["W"].append(end - middle)
    skip = min(3, rounds // 4)
    med = {name: statistics.median(values[skip:]) for name, values in times.items()}
    return {
        "stack": spec,
        "owners": owners,
        "ruled": ruled,
        "ordinary_ms": med["ordinary"] * 1e3,
        "I_ms": med["I"] * 1e3,
        "W_ms": med["W"] * 1e3,
        "ratio": med["split"] / med["ordinary"],
        "max_abs_diff": diff,
    }


def profile(spec: str, rounds: int) -> dict[str, float]:
    """The parts of I + W, each over the ordinary backward (medians of ``rounds``)."""
    # The split's internals, timed one by one: the private helpers are what backward_input runs.
    from torch.autograd.graph import get_gradient_edge

    from lightning_pipe.execution.split_backward import _owners, _walk
    from lightning_pipe.execution.weight_rules import weight_side

    layers, width, batch, tokens = (int(v) for v in spec.split("x"))
    module = stack(layers, width)
    g = torch.randn(batch, tokens, width)
    parts: dict[str, list[float]] = {
        "ordinary": [],
        "I_engine": [],
        "analysis": [],
        "W_rules": [],
        "W_engine": [],
    }
    for _ in range(rounds):
        _clear(module)
        x = torch.randn(batch, tokens, width, requires_grad=True)
        y = module(x)
        start = time.perf_counter()
        y.backward(g)
        parts["ordinary"].append(time.perf_counter() - start)

        _clear(module)
        x = torch.randn(batch, tokens, width, requires_grad=True)
        y = module(x)
        roots = [get_gradient_edge(y).node]
        start = time.perf_counter()
        graph = _walk(roots, {get_gradient_edge(x).node})
        _owners(graph, roots)
        middle = time.perf_counter()
        torch.autograd.backward([y], [g], inputs=[x], retain_graph=True)
        end = time.perf_counter()
        parts["analysis"].append(middle - start)
        parts["I_engine"].append(end - middle)

        _clear(module)
        x = torch.randn(batch, tokens, width, requires_grad=True)
        work = backward_input([module(x)], [g], [x])
        start = time.perf_counter()
        pairs = []
        weights = []
        for owner in work.owners:
            pairs += weight_side(owner.node, owner.recorded or (), owner.edges) or []
            weights += owner.weights
        middle = time.perf_counter()
        torch.autograd.backward([e for e, _ in pairs], [t for _, t in pairs], inputs=weights)
        parts["W_engine"].append(time.perf_counter() - middle)
        parts["W_rules"].append(middle - start)
    skip = min(3, rounds // 4)
    med = {name: statistics.median(values[skip:]) for name, values in parts.items()}
    return {"stack": spec, "ordinary_ms": med["ordinary"] * 1e3} | {  # type: ignore[dict-item]
        name: value / med["ordinary"] for name, value in med.items() if name != "ordinary"
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stacks", nargs="+", default=list(STACKS), help="layers x width x batch x tokens")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--autocast", action="store_true", help="forward under bfloat16 autocast")
    parser.add_argument("--profile", action="store_true", help="where the time of I + W goes")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    warn_if_busy()
    torch.set_num_threads(1)
    results = [measure(spec, args.rounds, args.autocast) for spec in args.stacks]
    profiles = [profile(spec, args.rounds) for spec in args.stacks] if args.profile else []
    if args.json:
        emit_json({"target": TARGET, "autocast": args.autocast, "stacks": results, "profile": profiles})
        return
    headers = ["stack", "owners", "ruled", "ordinary ms", "I ms", "W ms", "I+W / ordinary", "max |diff|"]
    keys = ["stack", "owners", "ruled", "ordinary_ms", "I_ms", "W_ms", "ratio", "max_abs_diff"]
    print_table(headers, [[r[k] for k in keys] for r in results])
    print(f"target: I+W / ordinary <= {TARGET}")
    if profiles:
        print("\nwhere the time goes, over the ordinary backward:")
        keys = ["stack", "ordinary_ms", "I_engine", "analysis", "W_rules", "W_engine"]
        print_table(
            ["stack", "ordinary ms", "I engine", "I analysis", "W rules", "W engine"],
            [[p[k] for k in keys] for p in profiles],
        )


if __name__ == "__main__":
    main()
