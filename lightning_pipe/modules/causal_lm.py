"""A ready LightningModule for fine-tuning (or pre-training) a Hugging Face causal LM.

Everything ``pipe_tp`` needs comes from the model itself (its pipeline and tensor-parallel plans;
see :mod:`lightning_pipe.huggingface`), so this module is what a user would write anyway: the
model built in ``configure_model()`` (on the meta device under ``pipe_tp``: each rank then holds
only its stage, and ``PipeTPStrategy(pretrained=DIR)`` loads each stage's weights), the loss the
Hugging Face way (``self.model(**batch).loss``), AdamW with a linear warm-up and a cosine decay.
``trainer.validate`` and ``trainer.test`` log ``val_loss`` and ``test_loss``; ``trainer.predict``
returns the logits. Batches are what Hugging Face's collators give: dicts with ``input_ids`` and
optionally ``attention_mask``, ``position_ids`` and ``labels`` (``-100`` where a token is not a
target).

From LightningCLI: ``--model lightning_pipe.CausalLMModule --model.model=DIR`` (or a config given
as a dict, e.g. ``{"model_type": "llama", "hidden_size": 64, ...}``, for a model from scratch).
"""

from __future__ import annotations

import math
import os
from typing import Any

import lightning as L
import torch


def _config(model: str | os.PathLike[str] | dict[str, Any], attn_implementation: str | None) -> Any:
    from transformers import AutoConfig

    if isinstance(model, dict):
        values = dict(model)
        model_type = values.pop("model_type", None)
        if model_type is None:
            raise ValueError(
                "A model given as a dict is a Hugging Face config and needs its 'model_type' (e.g. "
                f"'llama'); got the keys {sorted(values)}."
            )
        config = AutoConfig.for_model(model_type, **values)
    else:
        config = AutoConfig.from_pretrained(os.fspath(model))
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    config.use_cache = False  # training: no key/value cache (and packed sequences are honoured)
    return config


class CausalLMModule(L.LightningModule):
    """Causal language modelling with a Hugging Face model.

    Args:
        model: a local directory with ``config.json`` (and weights, which are loaded: under
            ``pipe_tp`` by ``PipeTPStrategy(pretrained=...)`` set to the same directory, stage by
            stage; otherwise by ``from_pretrained``), or a config as a dict with ``model_type``
            (a model from scratch).
        lr: AdamW's peak learning rate.
        weight_decay: AdamW's weight decay (not applied to biases and norm weights).
        betas: AdamW's betas.
        warmup_steps: steps of linear warm-up from 0 to ``lr``.
        min_lr_ratio: the cosine decay ends at ``lr * min_lr_ratio`` after the run's last step.
        attn_implementation: ``"sdpa"`` (default of most families), ``"eager"``, ... or ``None``
            for the config's.
    """

    def __init__(
        self,
        model: str | dict[str, Any],
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.1,
        attn_implementation: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None  # built in configure_model()

    def configure_model(self) -> None:
        if self.model is not None:
            return  # every Trainer call runs the hook: build once
        from transformers import AutoModelForCausalLM

        source = self.hparams["model"]
        local = not isinstance(source, dict) and os.path.isdir(os.fspath(source))
        files = os.listdir(os.fspath(source)) if local else []
        safetensors = any(f.endswith(".safetensors") for f in files)
        pickled = any(f.startswith("pytorch_model") and ".bin" in f for f in files)
        hub = not isinstance(source, dict) and not local  # a Hub id: its weights are to download
        strategy = self._trainer.strategy if self._trainer is not None else None
        pipe_tp = getattr(strategy, "strategy_name", None) == "pipe_tp"
        if pipe_tp and hub:
            raise ValueError(
                f"model={source!r} is not a local directory: under pipe_tp each rank reads its own stage's "
                f"weights from local files. Download it first (e.g. `hf download {source} --local-dir DIR`), "
                "then pass model=DIR and PipeTPStrategy(pretrained=DIR)."
            )
        config = _config(source, self.hparams["attn_implementation"])
        if not pipe_tp:
            if hub or safetensors or pickled:
                # from_pretrained returns the model in eval mode, and Lightning keeps the mode a
                # module starts fit in: dropout would be off on one device and on under pipe_tp
                # (from_config gives train mode there). Train mode, as Hugging Face's Trainer does.
                self.model = AutoModelForCausalLM.from_pretrained(os.fspath(source), config=config).train()
            else:
                self.model = AutoModelForCausalLM.from_config(config)
            return
        # Under pipe_tp the model is built on the meta device: each rank materialises its own stage,
        # from the strategy's pretrained files when given.
        pretrained = getattr(strategy, "pretrained", None)
        if pickled and not safetensors:
            raise ValueError(
                f"{source} holds its weights as pytorch_model*.bin, which pipe_tp does not read stage by "
                "stage; save them as safetensors once (AutoModelForCausalLM.from_pretrained(DIR)"
                ".save_pretrained(NEW_DIR)) and pass NEW_DIR."
            )
        if safetensors and pretrained is None:
            raise ValueError(
                f"{source} holds weights, which pipe_tp loads stage by stage only when told: set "
                f"PipeTPStrategy(pretrained={os.fspath(source)!r}) (from LightningCLI: "
                f"--trainer.strategy.pretrained={os.fspath(source)}); to start from scratch with its "
                "config only, copy config.json to a directory of its own."
            )
        self.model = AutoModelForCausalLM.from_config(config)

    def forward(self, **batch: Any) -> Any:
        assert self.model is not None, "configure_model() builds the model"
        return self.model(**batch)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        output = self(**batch)
        self.log("train_loss", output.loss, prog_bar=True)
        self._log_balancing("train", output)
        return output.loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        output = self(**batch)
        # Perplexity is exp of the epoch's val_loss (a mean of per-batch exp(loss) is another number).
        self.log("val_loss", output.loss, prog_bar=True, sync_dist=True)
        self._log_balancing("val", output, sync_dist=True)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        output = self(**batch)
        self.log("test_loss", output.loss, prog_bar=True, sync_dist=True)
        self._log_balancing("test", output, sync_dist=True)

    def predict_step(
        self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> torch.Tensor:
        """The logits, ``(batch, sequence, vocabulary)``, on the CPU: what scoring starts from
        (Lightning's default step would call ``self(batch)``, which ``forward(**batch)`` cannot
        take). Labels, when the batch has them, are dropped: no loss is wanted here. Under
        context parallelism each rank returns its chunks of the sequence. A batch's logits are
        ``batch x sequence x vocabulary`` floats, kept for every batch by ``trainer.predict``
        (``return_predictions``): for a large vocabulary, score in a callback instead."""
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
        return self(**inputs).logits

    def _log_balancing(self, stage: str, output: Any, **options: Any) -> None:
        """A mixture of experts with ``output_router_logits=True`` adds ``router_aux_loss_coef``
        times its router load-balancing loss to the loss: logged apart, as ``{stage}_aux_loss``
        (the balancing loss) and ``{stage}_lm_loss`` (the language model's alone)."""
        aux = getattr(output, "aux_loss", None)
        if aux is None or output.loss is None:
            return
        coefficient = float(getattr(self.model, "router_aux_loss_coef", 0.0))
        self.log(f"{stage}_aux_loss", aux.detach(), **options)
        self.log(f"{stage}_lm_loss", output.loss.detach() - coefficient * aux.detach(), **options)

    def configure_optimizers(self) -> Any:
        assert self.model is not None, "configure_model() builds the model"
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for name, param in self.named_parameters():
            if not param.requires_grad:
                continue
            (no_decay if param.ndim < 2 or "norm" in name.lower() else decay).append(param)
        hp = self.hparams
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": hp["weight_decay"]},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=hp["lr"],
            betas=tuple(hp["betas"]),
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup, floor = int(hp["warmup_steps"]), float(hp["min_lr_ratio"])

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
