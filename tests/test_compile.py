"""``compile``: each pipeline layer compiled with ``torch.compile`` trains like the eager layers.

A tiny GPT (embedding, two blocks, head; tests/gpt_models.py) runs the same three steps eager and
compiled on the same ranks, and the losses, every gradient and the weights after three SGD steps
must agree within 1e-5: under GPipe, 1F1B, interleaved 1F1B and ZB-H1 at pp=2, with
recomputation (and dropout replayed under it), with tensor and sequence parallelism (tp=2), with
FSDP2 (dp=2) and with a skip connection across the stages. The equality runs use the
``aot_eager`` backend (AOTAutograd's joint forward/backward graph, what splits the backward,
without inductor's code generation time), through a backend that counts its graphs' calls, so a
layer silently left eager would fail the test. Every compiled case also runs with
``fullgraph=True``: nothing of lightning_pipe's breaks a layer's graph.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn

import lightning_pipe
from lightning_pipe.execution.compile import compile_arguments, compile_layers, compiled_here
from lightning_pipe.runtime import RuntimeOptions
from tests.distributed import run_distributed
from tests.gpt_models import SEQ, SEQUENCE_PLAN, VOCAB, TinyGPT

TOL = 1e-5
STEPS = 3

# (id, (dp, pp, tp), options, dropout, skip). 1F1B is the recomputed case's schedule, ZB-H1 the
# skip case's and the other recomputed one's (plain 1F1B and ZB-H1 cases: equal too, 0.0).
CASES: list[tuple[str, tuple[int, int, int], dict[str, Any], float, bool]] = [
    ("gpipe", (1, 2, 1), {"schedule": "gpipe"}, 0.0, False),
    ("interleaved", (1, 2, 1), {"schedule": "interleaved_1f1b", "virtual_stages": 2}, 0.0, False),
    ("1f1b-recompute-dropout", (1, 2, 1), {"recompute": "always"}, 0.2, False),
    ("zb_h1-recompute-dropout", (1, 2, 1), {"schedule": "zb_h1", "recompute": "except_last"}, 0.2, False),
    ("skip", (1, 2, 1), {"schedule": "zb_h1"}, 0.0, True),
    (
        "tp-sequence",
        (1, 1, 2),
        {"tensor_parallel_plan": SEQUENCE_PLAN, "sequence_parallel": True},
        0.0,
        False,
    ),
    ("fsdp2", (2, 1, 1), {"shard_parameters": True}, 0.0, False),
    ("hugging-face-llama", (1, 2, 1), {"hugging_face": True}, 0.0, False),
]


class Counting:
    """A ``torch.compile`` backend: ``aot_eager``, counting the calls of the graphs it compiled."""

    def __init__(self) -> None:
        self.graphs = 0
        self.calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs += 1
        compiled = torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

        def run(*args: Any) -> Any:
            self.calls += 1
            return compiled(*args)

        return run


class _SkipHead(nn.Module):
    """The head, given the embedding's output (popped) added to its input."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(self, x: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        return self.head(x + embedded)


def _model(dropout: float, skip: bool) -> tuple[nn.Module, list[nn.Module]]:
    from lightning_pipe.skip import Pop, Stash

    model = TinyGPT(dropout=dropout)
    if not skip:
        return model, list(model.layers)
    # The embedding's output joins the head's input, across the stage boundary.
    embed, first, second, head = model.layers
    skipping = nn.Sequential(Stash("embedded", embed), first, second, Pop("embedded", _SkipHead(head)))
    return skipping, list(skipping)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (8, SEQ + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def _whole(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach().clone()


def _hf_head(output: torch.Tensor, microbatch: Any) -> torch.Tensor:
    from lightning_pipe.huggingface.outputs import causal_lm_loss

    return causal_lm_loss(output, microbatch.data["labels"])


def _train(
    sizes: tuple[int, int, int], options: dict[str, Any], dropout: float, skip: bool, compile: Any
) -> dict[str, Any]:
    from lightning_pipe.huggingface import CausalLMPipeline
    from lightning_pipe.mesh import ParallelLayout, init_mesh
    from lightning_pipe.runtime import ParallelRuntime
    from lightning_pipe.tensor_parallel import cross_entropy
    from tests.hf_families import batches, build

    mesh = init_mesh(ParallelLayout(*sizes), "cpu")
    options = dict(options)
    hugging_face = options.pop("hugging_face", False)
    opts = RuntimeOptions(num_microbatches=4, timeout=timedelta(seconds=60), compile=compile, **options)
    if hugging_face:  # a tiny Llama, pipelined from its own plan
        model = build("llama")
        pipeline = CausalLMPipeline(model)
        runtime = ParallelRuntime(
            model, pipeline.layers(), mesh, torch.device("cpu"), opts, seed=0, hooks=pipeline.hooks()
        )
        data: list[Any] = batches("padded", STEPS, 8)
        head: Any = _hf_head
    else:
        model, layers = _model(dropout, skip)
        runtime = ParallelRuntime(model, layers, mesh, torch.device("cpu"), opts, seed=0)
        data = _batches()
        head = lambda out, mb: cross_entropy(out, mb.data[1])  # noqa: E731
    optimizer = runtime.keep_own(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    dp = mesh.coordinates.dp_rank
    losses, grads = [], []
    for batch in data:
        optimizer.zero_grad()
        runtime.begin_accumulation()
        if isinstance(batch, dict):
            mine: Any = {k: v.chunk(sizes[0])[dp] for k, v in batch.items()}
        else:
            mine = tuple(t.chunk(sizes[0])[dp] for t in batch)
        result = runtime.train_batch(mine, head)
        losses.append(result.loss)
        grads.append({n: _whole(p.grad) for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
    weights = {n: _whole(p) for n, p in model.named_parameters()}
    runtime.close()
    return {"losses": losses, "grads": grads, "weights": weights}


def compile_worker(
    cases: list[tuple[str, tuple[int, int, int], dict[str, Any], float, bool]],
) -> dict[str, Any]:
    torch._dynamo.utils.set_compilation_metrics_limit(1000)  # every frame of a case (default 64)
    out: dict[str, Any] = {}
    for name, sizes, options, dropout, skip in cases:
        eager = _train(sizes, options, dropout, skip, False)
        # Each case is a new model and backend for the same classes' forward: Dynamo's cache would
        # keep every case's entries (past its recompile limit); a process trains one model.
        torch._dynamo.reset()
        backend = Counting()
        # Tensor parallelism's collectives break the graph (refused with fullgraph, tested below).
        fullgraph = sizes[2] == 1
        torch._dynamo.utils.clear_compilation_metrics()
        compiled = _train(sizes, options, dropout, skip, {"backend": backend, "fullgraph": fullgraph})
        out[name] = {
            "eager": eager,
            "compiled": compiled,
            "graphs": backend.graphs,
            "calls": backend.calls,
            "frames": _compiled_frames(),
        }
    return out


def _compiled_frames() -> list[tuple[str, str, str]]:
    """Each frame Dynamo compiled since the metrics were cleared: its file, function and, for a
    recompilation, the guard that failed ("" for a first compilation)."""
    return [
        (str(m.co_filename), str(m.co_name), m.recompile_reason or "")
        for m in torch._dynamo.utils.get_compilation_metrics()
        if m.co_filename is not None  # AOTAutograd's own entries (the backward's)
    ]


def _max_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    worst = max(
        (abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True) if x is not None), default=0.0
    )
    for ga, gb in zip(a["grads"], b["grads"], strict=True):
        assert ga.keys() == gb.keys()
        worst = max([worst, *((ga[n] - gb[n]).abs().max().item() for n in ga)])
    assert a["weights"].keys() == b["weights"].keys()
    return max([worst, *((a["weights"][n] - b["weights"][n]).abs().max().item() for n in a["weights"])])


@pytest.fixture(scope="module")
def compiled_cases() -> list[dict[str, Any]]:
    """Every case trained eager and compiled on two ranks: one launch for the tests below."""
    return run_distributed(compile_worker, 2, CASES, timeout=300)


@pytest.mark.distributed
def test_compiled_layers_train_like_eager_layers(compiled_cases: list[dict[str, Any]]) -> None:
    got = compiled_cases
    for name, *_ in CASES:
        for rank, r in enumerate(got):
            case = r[name]
            # The compiled graphs ran: at least one per micro-batch forward of each held layer.
            assert case["graphs"] >= 1 and case["calls"] >= STEPS * 4, (
                name,
                rank,
                case["graphs"],
                case["calls"],
            )
            difference = _max_difference(case["eager"], case["compiled"])
            print(f"{name} rank {rank}: max |compiled - eager| = {difference:.2e}")
            assert difference <= TOL, (name, rank, difference)


@pytest.mark.distributed
def test_no_layer_is_compiled_again_for_a_shape_nor_a_tensor_parallel_layer_on_its_own(
    compiled_cases: list[dict[str, Any]],
) -> None:
    """Dynamo compiles each layer's code once for its shapes: no frame is compiled again because a
    tensor's size differs from its first compilation's, and no code of lightning_pipe (the
    tensor-parallel layers and hooks, with their collectives, run eagerly between a layer's graphs)
    is compiled as a frame of its own. Before, the sharded layers' ``forward`` (one code object for
    every column or row layer) was compiled anew for each layer's weight shape and for the whole
    and the split sequence: 15 graphs instead of 6 in the tensor-parallel case, a recompile each
    (with more layer shapes, up to Dynamo's recompile limit, 8, past which the layer runs eager)."""
    library = os.path.dirname(lightning_pipe.__file__) + os.sep
    for name, *_ in CASES:
        for rank, r in enumerate(compiled_cases):
            frames = r[name]["frames"]
            assert frames, (name, rank)  # the metrics were recorded
            resized = [f for f in frames if "size mismatch" in f[2]]
            assert not resized, (name, rank, resized)
            ours = [f for f in frames if f[0].startswith(library)]
            assert not ours, (name, rank, ours)


def test_the_option_is_checked_when_made() -> None:
    assert RuntimeOptions().compile_arguments is None
    assert RuntimeOptions(compile=True).compile_arguments == {}
    assert compile_arguments({"backend": "aot_eager", "fullgraph": True}) == {
        "backend": "aot_eager",
        "fullgraph": True,
    }
    with pytest.raises(ValueError, match="compile must be True, False or a dict"):
        RuntimeOptions(compile="yes")
    with pytest.raises(ValueError, match=r"not an argument of torch\.compile"):
        RuntimeOptions(compile={"backnd": "eager"})
    with pytest.raises(ValueError, match="compile=False switches compilation off"):
        RuntimeOptions(compile={"disable": True})


def test_a_layer_compiled_by_its_user_is_run_as_it_is() -> None:
    plain, user_wrapped, user_in_place = nn.Linear(2, 2), torch.compile(nn.Linear(2, 2)), nn.Linear(2, 2)
    user_in_place.compile()
    done = compile_layers([plain, user_wrapped, user_in_place], {"backend": "eager"})
    assert done == [plain] and compiled_here(plain)
    assert not compiled_here(user_wrapped) and not compiled_here(user_in_place)
    assert compile_layers([plain], {"backend": "eager"}) == []  # a second setup compiles nothing again
    assert [n for n, _ in plain.named_parameters()] == ["weight", "bias"]  # names unchanged
    with pytest.raises(ValueError, match="collectives break the compiled graph"):
        compile_layers([nn.Linear(2, 2)], {"fullgraph": True}, tensor_parallel_size=2)


class _TinyBlock(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm, self.fc, self.drop = nn.LayerNorm(8), nn.Linear(8, 8), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.fc(self.norm(x))))


def _forward_backward(block: nn.Module, recompute: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(3)
    x = torch.randn(4, 8, requires_grad=True)
    out = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
    out.pow(2).sum().backward()
    grads = [x.grad, *(p.grad for p in block.parameters())]
    block.zero_grad()
    return out.detach(), [g.detach().clone() for g in grads]  # type: ignore[union-attr]


class _ScaleBlock(nn.Module):
    """The smallest layer with a weight, a reduction in its backward and a dropout: inductor
    generates (and gcc compiles, cold on every CI run) fewer kernels for it than for
    :class:`_TinyBlock`'s norm and matrix product, which its equality with eager does not need."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.weight, self.drop = nn.Parameter(torch.randn(8)), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(x * self.weight))


def test_inductor_compiles_a_layer_equal_to_eager_and_replays_its_dropout_under_recomputation() -> None:
    """The default backend (inductor, C++ code generated with gcc): a layer's forward and gradients
    equal eager; with dropout, inductor draws its own masks (not eager's: torch's
    ``torch._inductor.config.fallback_random=True`` makes them eager's), and recomputation, which
    restores the random state, replays them."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = _ScaleBlock()
    compiled = _ScaleBlock()
    compiled.load_state_dict(eager.state_dict())
    assert compile_layers([compiled], {}) == [compiled]
    want, want_grads = _forward_backward(eager, recompute=False)
    got, got_grads = _forward_backward(compiled, recompute=False)
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=TOL, rtol=0)
    dropping = _ScaleBlock(dropout=0.5)
    compile_layers([dropping], {})
    once, once_grads = _forward_backward(dropping, recompute=False)
    replayed, replayed_grads = _forward_backward(dropping, recompute=True)
    torch.testing.assert_close(replayed, once, atol=0, rtol=0)
    for g, w in zip(replayed_grads, once_grads, strict=True):
        torch.testing.assert_close(g, w, atol=TOL, rtol=0)


def test_the_forward_check_puts_a_compiled_forward_back() -> None:
    """The first step's forward check stands stubs in for the layers' ``forward``; a compiled
    layer's instance ``forward`` must be there again after it (it was deleted: the layers ran eager)."""
    from lightning_pipe.batches.forward_contract import check_forward

    # The second layer compiled by its user: an OptimizedModule, whose forward is an instance
    # attribute too (deleted, its next call raised "missing the required forward function").
    model = nn.Sequential(nn.Linear(2, 2), torch.compile(nn.Linear(2, 2), backend="eager"))
    compile_layers(list(model), {"backend": "eager"})
    compiled = [layer.forward for layer in model]
    check_forward(model.forward, list(model), model, torch.randn(3, 2))
    assert [layer.forward for layer in model] == compiled
    model(torch.randn(3, 2))


def test_the_split_backward_computes_a_compiled_layers_weights_in_its_input_pass() -> None:
    """ZB-H1's weight pass and a compiled layer: the layer's backward is one AOTAutograd node (a
    custom autograd Function) computing all of its gradients, so the input pass computes them,
    with the graph kept for the weight pass (donated buffers off for that call), and the weight
    pass has nothing of the layer's left; an eager layer's weights wait for the weight pass."""
    from lightning_pipe.execution.split_backward import backward_input

    torch._dynamo.reset()
    for compiled in (False, True):
        torch.manual_seed(0)
        block = _TinyBlock()
        if compiled:
            compile_layers([block], {"backend": "aot_eager", "fullgraph": True})
        x = torch.randn(4, 8, requires_grad=True)
        out = block(x)
        assert ("CompiledFunction" in type(out.grad_fn).__name__) is compiled
        work = backward_input([out], [torch.ones_like(out)], [x])
        assert x.grad is not None
        assert all(p.grad is not None for p in block.parameters()) is compiled
        assert (not work.owners and not work.passes) is compiled
        work.run()
        assert all(p.grad is not None for p in block.parameters())
        # A first stage (no input gradient): the whole backward is the weight pass, graph kept.
        block.zero_grad()
        out = block(torch.randn(2, 3, 8))  # 3-d: its compiled backward has donated buffers
        work = backward_input([out], [torch.ones_like(out)], [])
        work.run()
        assert all(p.grad is not None for p in block.parameters())


def test_the_strategy_takes_the_option_and_documents_it_once() -> None:
    from lightning_pipe import PipeTPStrategy

    strategy = PipeTPStrategy(compile={"backend": "aot_eager", "fullgraph": True})
    assert strategy.options.compile_arguments == {"backend": "aot_eager", "fullgraph": True}
    assert PipeTPStrategy().options.compile_arguments is None
    assert "    compile: ``torch.compile`` each pipeline layer" in (PipeTPStrategy.__doc__ or "")
    with pytest.raises(ValueError, match="compile must be True, False or a dict"):
        PipeTPStrategy(compile="yes")
