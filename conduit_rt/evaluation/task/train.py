"""Train the task model from scratch and ship it as a Hugging Face folder (Qwen2-VL or LLaVA).

    python -m conduit_rt.evaluation.task.train --out runs/quality --minutes 6.2 \
        --train-pages 20000 --eval-pages 2000 --stale-requests 0          # GPU: the shipped model
    python -m conduit_rt.evaluation.task.train --out /tmp/q --tiny           # CPU smoke run, seconds

Plain PyTorch: the architecture's transformers model (``architectures.py``: Qwen2-VL by default,
LLaVA-1.5) in float32 with bfloat16 autocast on CUDA, AdamW,
linear warmup then cosine decay over the time budget, loss on the answer tokens (and EOS) only,
length-bucketed batches of 1-8 pages (a short page-count curriculum first), one task family per
batch, the families in turn. Pages are rendered once into a pool per page layout kept on the device; DataLoader workers only tokenize. ``--minutes`` is the wall-clock
budget of the whole run; training stops early enough to leave room for the final evaluation.
Writes ``<out>/model`` (bfloat16 safetensors + tokenizer + processor files) and
``<out>/metrics.json``, and prints the metrics as the last line (JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import time

START_TIME = time.time()

import torch  # noqa: E402

from .architectures import ARCHITECTURES, TaskArchitecture, architecture  # noqa: E402
from .data import PromptEncoder, TrainStream, build_pools, max_pages_for  # noqa: E402
from .evaluate import accuracy_by_pages, exact_match, greedy_answers  # noqa: E402
from .families import FAMILIES  # noqa: E402
from .model_config import count_parameters  # noqa: E402
from .attention_hint import attention_hint_loss, field_hint_loss  # noqa: E402
from .context_probe import ContextProbe, probe_layer  # noqa: E402
from .reading_loss import ReadingHead, cell_labels  # noqa: E402


def log(message: str, **values) -> None:
    """One progress line on stdout, flushed (the run is watched remotely)."""
    elapsed = time.time() - START_TIME
    extra = " ".join(f"{key}={value}" for key, value in values.items())
    print(f"[{elapsed:7.1f}s] {message} {extra}".rstrip(), flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cpus = os.cpu_count() or 1
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output folder (model/ and metrics.json)")
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="qwen2vl", help="the model's architecture")
    parser.add_argument("--families", default=None, help="task families trained and measured, comma-separated, "
                        f"from {', '.join(FAMILIES)} (default: those of the shipped model, lookup and fields; LLaVA: lookup)")
    parser.add_argument("--family-weights", default="",
                        help="training rounds per family in each cycle, name=count, comma-separated (default: 1 each)")
    parser.add_argument("--size", default="default", help="the architecture's size preset (default, small, tiny)")
    parser.add_argument("--minutes", type=float, default=8.0, help="wall-clock budget of the whole run")
    parser.add_argument("--max-steps", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=96)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--warmup-steps", type=int, default=300)
    parser.add_argument("--reading-weight", type=float, default=0.5,
                        help="weight of the auxiliary per-cell reading loss (0: answer loss only)")
    parser.add_argument("--probe-weight", type=float, default=0.5,
                        help="weight of the auxiliary context probes on the decoder (0: off)")
    parser.add_argument("--hint-weight", type=float, default=0.5,
                        help="weight of the auxiliary reading hint (needs --probe-weight > 0; 0: off)")
    parser.add_argument("--field-weight", type=float, default=0.5,
                        help="weight of the auxiliary field hint: question tokens look at the asked fields "
                             "(needs --probe-weight > 0; 0: off)")
    parser.add_argument("--curriculum", type=float, default=0.25, help="fraction of training to reach 8 pages")
    parser.add_argument("--followups", type=int, default=3,
                        help="training conversations ask 1 + 0..followups questions (more answer tokens per pass)")
    parser.add_argument("--max-pages", type=int, default=8, help="most pages per request (train and eval)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-pages", type=int, default=60_000, help="train pool size of each page layout")
    parser.add_argument("--eval-pages", type=int, default=4_000, help="pool size of val and of test")
    parser.add_argument("--val-requests", type=int, default=512)
    parser.add_argument("--test-requests", type=int, default=2_000)
    parser.add_argument("--stale-requests", type=int, default=128, help="test requests for the stale-KV check (0: skip)")
    parser.add_argument("--eval-every", type=int, default=1_000, help="steps between validation runs")
    parser.add_argument("--log-every", type=int, default=100, help="steps between progress lines")
    parser.add_argument("--workers", type=int, default=max(0, min(8, cpus - 2)))
    parser.add_argument("--render-processes", type=int, default=cpus)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke preset: tiny model, a few steps")
    args = parser.parse_args(argv)
    if args.size not in architecture(args.arch).sizes:
        parser.error(f"--size must be one of {architecture(args.arch).sizes} for {args.arch}")
    if args.tiny:
        args.size, args.max_steps, args.batch_size, args.train_pages, args.eval_pages = "tiny", 3, 4, 64, 32
        args.val_requests, args.test_requests, args.stale_requests, args.eval_every = 8, 8, 2, 2
        args.workers, args.render_processes, args.warmup_steps = 0, 1, 1
    return args


def learning_rate(step: int, progress: float, args: argparse.Namespace) -> float:
    """Linear warmup over ``warmup_steps``, then cosine from ``lr`` to lr/10 as ``progress`` -> 1."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(modules: list[torch.nn.Module], args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not on norms, biases, the class embedding)."""
    parameters = [p for module in modules for p in module.parameters()]
    decay = [p for p in parameters if p.ndim >= 2]
    no_decay = [p for p in parameters if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = args.device.startswith("cuda")
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), eps=1e-8, fused=fused)


def answer_loss(model, batch: dict[str, torch.Tensor], image_inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of the answer tokens (labels != -100), predicted from the previous position."""
    return training_losses(model, batch, image_inputs)["answer"]


def training_losses(model, batch: dict[str, torch.Tensor], image_inputs: dict[str, torch.Tensor],
                    probe: ContextProbe | None = None, hint: bool = False,
                    field: bool = False) -> dict[str, torch.Tensor]:
    """The answer loss, and with ``probe`` the context probes' loss ("probe") and, with ``hint`` /
    ``field`` too, the attention hints' losses at the layer above the probed one ("hint", "field").
    ``image_inputs``: the model's image keyword arguments (``TaskArchitecture.image_inputs``)."""
    out = model(input_ids=batch["input_ids"], **image_inputs, use_cache=False,
                output_hidden_states=probe is not None)
    losses = {"answer": torch.nn.functional.cross_entropy(
        out.logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(), ignore_index=-100
    )}
    if probe is not None:
        losses["probe"] = probe.loss(out.hidden_states, batch, model.config.image_token_id)
        if hint:
            losses["hint"] = attention_hint_loss(model, out.hidden_states, batch, probe.layer)
        if field:
            losses["field"] = field_hint_loss(model, out.hidden_states, batch, probe.layer)
    return losses


class FamilyData:
    """One family's train/val/test pools (uint8 pixels of the train and val pools on the device), its
    validation and test requests, and the reading head's labels of its train pages."""

    def __init__(self, family: str, pools: dict[str, dict], num_families: int, args: argparse.Namespace) -> None:
        self.family = family
        self.train, self.val, self.test = (pools[split][family] for split in ("train", "val", "test"))
        self.train_pixels = torch.from_numpy(self.train.pixels).to(args.device)
        self.val_pixels = torch.from_numpy(self.val.pixels).to(args.device)
        self.train_labels = torch.from_numpy(cell_labels(self.train.pages)).to(args.device)
        self.val_requests = self.val.requests(max(1, args.val_requests // num_families), family=family,
                                              max_pages=args.max_pages)
        self.test_requests = self.test.requests(max(1, args.test_requests // num_families), family=family,
                                                max_pages=args.max_pages)


def evaluate(model, arch: TaskArchitecture, encoder, data: dict[str, FamilyData], device: str) -> dict[str, float]:
    """Validation exact match of each family (greedy, full prefill)."""
    model.eval()
    scores = {}
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
        for family, item in data.items():
            answers = greedy_answers(model, encoder, item.val_requests, item.val, batch_size=128,
                                     pool_pixels_on_device=item.val_pixels, image_inputs=arch.image_inputs)
            scores[family] = exact_match(answers, item.val_requests)
    model.train()
    return scores


def family_weights(text: str) -> dict[str, int]:
    """"where=3,describe=2" -> {"where": 3, "describe": 2}."""
    weights = {}
    for item in filter(None, text.split(",")):
        name, _, count = item.partition("=")
        weights[name.strip()] = int(count)
    return weights


def train_families(args: argparse.Namespace, arch: TaskArchitecture) -> list[str]:
    families = arch.trained_families if args.families is None else [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in arch.families]
    if unknown:
        raise SystemExit(f"the {arch.name} task model cannot take the {', '.join(unknown)} family pages")
    return list(families)


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    device = args.device
    arch = architecture(args.arch)
    families = train_families(args, arch)
    tokenizer = arch.build_tokenizer()
    encoder = PromptEncoder(tokenizer, arch.frame)
    sizes = {"train": args.train_pages, "val": args.eval_pages, "test": args.eval_pages}
    pools = {split: build_pools(args.seed, split, size, families, args.render_processes) for split, size in sizes.items()}
    data = {family: FamilyData(family, pools, len(families), args) for family in families}
    log("pools rendered", families=",".join(families), **{split: sizes[split] for split in sizes})

    model = arch.new_model(tokenizer, args.size, args.seed).to(device).train()
    text_config = model.config.text_config
    reading_head = ReadingHead(text_config.hidden_size).to(device)
    probe = ContextProbe(text_config.hidden_size, probe_layer(text_config.num_hidden_layers)).to(device)
    if args.reading_weight > 0:
        reading_head.attach(model)
    optimizer = make_optimizer([model, reading_head, probe], args)
    log("model ready", arch=arch.name, parameters=count_parameters(model), device=device)

    progress_value = multiprocessing.Value("d", 0.0)
    stream = TrainStream({family: data[family].train.pages for family in families}, args.seed, tokenizer,
                         args.batch_size, progress_value, args.curriculum, max_pages=args.max_pages,
                         max_followups=args.followups, frame=arch.frame, weights=family_weights(args.family_weights))
    loader = torch.utils.data.DataLoader(
        stream, batch_size=None, num_workers=args.workers, pin_memory=device.startswith("cuda"),
        prefetch_factor=8 if args.workers else None, persistent_workers=bool(args.workers),
    )
    # time kept for saving and the final evaluations (the stale-KV check runs one request at a time)
    reserve_s = 30.0 + 0.25 * args.stale_requests if device.startswith("cuda") else 5.0
    train_start = time.time()
    train_budget = max(1.0, args.minutes * 60 - (train_start - START_TIME) - reserve_s)
    step, tokens, eval_seconds = 0, 0, 0.0
    running = {"answer": 0.0, "reading": 0.0, "probe": 0.0, "hint": 0.0, "field": 0.0}
    weights = {"answer": 1.0, "reading": args.reading_weight, "probe": args.probe_weight, "hint": args.hint_weight,
               "field": args.field_weight}
    autocast = torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))
    for batch in loader:
        elapsed = time.time() - train_start
        progress = max(step / args.max_steps, elapsed / train_budget)
        if step >= args.max_steps or elapsed >= train_budget - eval_seconds:
            break
        progress_value.value = progress
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, progress, args)
        item = data[families[int(batch.pop("family"))]]
        batch = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
        image_inputs = arch.image_inputs(model, batch["input_ids"], item.train_pixels[batch["page_ids"]], torch.float32)
        if "position_ids" in image_inputs:  # the attention hints rotate with the model's positions
            batch["position_ids"] = image_inputs["position_ids"]
        with autocast:
            losses = training_losses(model, batch, image_inputs, probe if args.probe_weight > 0 else None,
                                     hint=args.hint_weight > 0, field=args.field_weight > 0)
            if args.reading_weight > 0:
                losses["reading"] = reading_head.loss(item.train_labels[batch["page_ids"]].long())
            total = sum(weights[name] * value for name, value in losses.items())
            for name, value in losses.items():
                running[name] += value.detach()
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        tokens += batch["input_ids"].numel()
        if step % args.log_every == 0 or step == args.max_steps:
            num_logged = args.log_every if step % args.log_every == 0 else step % args.log_every
            log("train", step=step, **{name: f"{float(value) / num_logged:.4f}" for name, value in running.items()},
                lr=f"{optimizer.param_groups[0]['lr']:.2e}", max_pages=max_pages_for(progress, args.curriculum, args.max_pages),
                tokens_per_s=f"{tokens / (time.time() - train_start):.0f}")
            running = dict.fromkeys(running, 0.0)
        if step % args.eval_every == 0:
            eval_start = time.time()
            scores = evaluate(model, arch, encoder, data, device)
            eval_seconds = max(eval_seconds, time.time() - eval_start)
            log("validation", step=step, **{f: f"{v:.4f}" for f, v in scores.items()}, seconds=f"{eval_seconds:.1f}")
    train_seconds = time.time() - train_start
    reading_head.detach()
    log("training done", steps=step, seconds=f"{train_seconds:.1f}")
    return finish(args, arch, model, tokenizer, encoder, data,
                  {"arch": arch.name, "families": families, "steps": step, "train_seconds": round(train_seconds, 1),
                   "tokens_per_step": round(tokens / max(step, 1))})


def finish(args, arch: TaskArchitecture, model, tokenizer, encoder, data: dict[str, FamilyData], stats: dict) -> dict:
    """Save the folder, then measure the saved (bfloat16) model per family: val, test, per page count,
    and (LLaVA) the stale-KV reference of ``stale_kv``."""
    folder = arch.write_folder(model, tokenizer, os.path.join(args.out, "model"))
    del model
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    shipped = arch.load(folder, dtype).to(args.device).eval()
    metrics = {**stats, "parameters": count_parameters(shipped),
               "model_bytes": os.path.getsize(os.path.join(folder, "model.safetensors")), "by_family": {}}
    for family, item in data.items():
        val_answers = greedy_answers(shipped, encoder, item.val_requests, item.val, batch_size=128,
                                     image_inputs=arch.image_inputs)
        test_answers = greedy_answers(shipped, encoder, item.test_requests, item.test, batch_size=128,
                                      image_inputs=arch.image_inputs)
        by_pages = accuracy_by_pages(test_answers, item.test_requests)
        metrics["by_family"][family] = {
            "val_exact_match": round(exact_match(val_answers, item.val_requests), 4),
            "test_exact_match": round(exact_match(test_answers, item.test_requests), 4),
            "test_exact_match_by_pages": {k: round(v, 4) for k, v in by_pages.items()},
            "test_requests": len(item.test_requests),
        }
    metrics["test_exact_match"] = round(min(f["test_exact_match"] for f in metrics["by_family"].values()), 4)
    if args.stale_requests and arch.name == "llava":  # float32: `fresh` (a chunked prefill) then matches closely
        from .stale_kv import stale_kv_report

        item = data["lookup"]
        metrics["stale_kv"] = stale_kv_report(shipped.float(), encoder, item.test_requests[: args.stale_requests],
                                              item.test)
    metrics["total_seconds"] = round(time.time() - START_TIME, 1)
    with open(os.path.join(args.out, "metrics.json"), "w") as file:
        json.dump(metrics, file, indent=2)
    print(json.dumps(metrics), flush=True)
    return metrics


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    log("start", **{key: value for key, value in vars(args).items() if key not in ("out",)})
    train(args)


if __name__ == "__main__":
    main()
