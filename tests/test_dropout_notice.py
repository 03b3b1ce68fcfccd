"""The layout log's line on dropout (issue 41, item 5): which modules draw it in training."""

from __future__ import annotations

from torch import nn

from lightning_pipe.runtime.dropout_notice import describe_dropout, dropout_sources


class Attention(nn.Module):
    """Like a Hugging Face attention module: a rate from the config, applied functionally."""

    def __init__(self) -> None:
        super().__init__()
        self.attention_dropout = 0.1
        self.proj = nn.Linear(2, 2)


def _model() -> nn.Sequential:
    return nn.Sequential(
        nn.Sequential(Attention(), nn.Dropout(0.2)), nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0))
    )


def test_modules_that_draw_dropout_are_named_with_their_rates() -> None:
    model = _model()
    sources = dropout_sources(model, list(model))
    assert sources == ["0.0 (attention_dropout=0.1)", "0.1 (p=0.2)"]
    line = describe_dropout(sources, layer_seeded=False)
    assert "drawn by 2 modules" in line and "layer_seeded_dropout=True" in line


def test_modules_in_eval_mode_draw_none() -> None:
    """A model left in eval (``from_pretrained`` gives one; Lightning keeps submodules' modes)
    draws no dropout in training: nothing to say."""
    model = _model().eval()
    assert dropout_sources(model, list(model)) == []
    model[0][1].train()
    assert dropout_sources(model, list(model)) == ["0.1 (p=0.2)"]
    assert describe_dropout([], layer_seeded=False) == ""


def test_router_jitter_is_named_as_it_draws_too() -> None:
    """Mixtral's router jitter (``router_jitter_noise``) scales the tokens by random noise in
    training: like dropout, it draws on other ranks and per micro-batch under a pipeline."""
    import transformers

    from tests.hf_families import config

    made = config("mixtral")
    made.router_jitter_noise = 0.01
    model = transformers.MixtralForCausalLM(made).train()
    layers = list(model.model.layers)
    assert dropout_sources(model, layers) == [f"model.layers.{i}.mlp (jitter_noise=0.01)" for i in range(4)]


def test_under_context_parallelism_the_line_says_each_rank_draws_its_part_and_seeding_is_refused() -> None:
    """Each rank of a context group draws the masks of its part of the sequences: the line says
    so whatever the seeding, and ``layer_seeded_dropout=True`` (the same masks on every layout) is
    refused rather than promised."""
    import pytest

    from lightning_pipe import PipeTPStrategy
    from lightning_pipe.runtime import RuntimeOptions

    sources = dropout_sources(_model(), list(_model()))
    for seeded in (False, True):
        line = describe_dropout(sources, layer_seeded=seeded, context_parallel_size=2)
        assert "context_parallel_size=2 each rank draws the masks of its part" in line, line
        assert "same masks on every" not in line and "layer_seeded_dropout=True draws" not in line
    refusal = (
        r"layer_seeded_dropout=True cannot promise .* context_parallel_size=2 .* "
        "leave layer_seeded_dropout unset"
    )
    with pytest.raises(ValueError, match=refusal):
        RuntimeOptions(context_parallel_size=2, layer_seeded_dropout=True)
    with pytest.raises(ValueError, match=refusal):
        PipeTPStrategy(data_parallel_size=2, context_parallel_size=2, layer_seeded_dropout=True)
    RuntimeOptions(context_parallel_size=2)  # unset: allowed (the layout log says what is drawn)
