"""The per-model step (models/gpt_step.py), the extra-loss channel and the parallelize phase,
on one process: the step computes exactly the loss the loop used to compute inline, an extra
loss term adds exactly scale * its gradient and is logged as its mean, parallelizing after
construction gives every module one tracker, captured by recompute, and the same values."""
import dataclasses

import pytest
import torch

from megalite.cli.arguments import parse_args
from megalite.config import MegaliteConfig, ModelConfig, ParallelConfig
from megalite.models.family import StepContext
from megalite.models.gpt import GPTModel, build_chunk, build_model, single_rank_state
from megalite.models.gpt_step import GPT_FAMILY, forward_step, get_batch
from megalite.models.parallelize import parallelize_chunk, spec_choices, stage_rng_tracker
from megalite.parallel_state import ParallelState, RankGrid
from megalite.pipeline_parallel.schedules import forward_backward_no_pipelining
from megalite.models.stages import build_model_chunks
from megalite.tensor_parallel.random import NO_TRACKER, DrawsFromTracker, model_parallel_tracker
from megalite.training.loop import Trainer, resolve_config
from megalite.transformer.extra_losses import add_extra_loss, collect_extra_losses
from megalite.transformer.recompute import FullRecompute

V, S, MBS, M = 70, 8, 2, 3
COEF = 0.3


def make_cfg(dropout=0.0, recompute=None, layers=2, pp=1):
    m = ModelConfig(num_layers=layers, hidden_size=32, num_attention_heads=4, seq_length=S,
                    vocab_size=V, make_vocab_size_divisible_by=16, hidden_dropout=dropout,
                    attention_dropout=dropout, normalization="RMSNorm", swiglu=True,
                    position_embedding_type="rope", add_bias_linear=False)
    cfg = MegaliteConfig(model=m, parallel=ParallelConfig(pipeline_model_parallel_size=pp),
                         world_size=pp)
    cfg.training.seed = 7
    if recompute:
        cfg.training.recompute_granularity = recompute
        cfg.training.recompute_method = "uniform" if recompute == "full" else None
    return cfg


def batches(n=M, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"tokens": torch.randint(0, V, (MBS, S), generator=g),
             "labels": torch.randint(0, V, (MBS, S), generator=g),
             "loss_mask": (torch.rand(MBS, S, generator=g) > 0.3).float()} for _ in range(n)]


def params(model):
    return {n: p.detach().clone() for n, p in model.canonical_named_parameters()}


def equal_params(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- the parallelize phase -------------------------------------------------------------------
def test_constructor_builds_structure_and_parallelize_applies_policy():
    cfg, state = make_cfg(dropout=0.1, recompute="full"), single_rank_state()
    built = build_model(cfg, state)               # spec choices + GPTModel + parallelize_chunk
    bare = GPTModel(cfg, state, spec=spec_choices(cfg, state))   # structure only
    assert bare.rng_tracker is NO_TRACKER and bare.decoder.recompute is None
    assert all(m.rng_tracker is NO_TRACKER for m in bare.modules()
               if isinstance(m, DrawsFromTracker))
    raw = params(bare)
    by_hand = GPTModel(cfg, state, spec=spec_choices(cfg, state))
    parallelize_chunk(by_hand, cfg, state)
    assert equal_params(params(built), params(by_hand))
    assert not equal_params(params(built), raw)
    # one tracker on every module that forks it, captured by the recompute policy
    holders = [m for m in built.modules() if isinstance(m, DrawsFromTracker)]
    assert len(holders) >= 3 and all(m.rng_tracker is built.rng_tracker for m in holders)
    assert isinstance(built.decoder.recompute, FullRecompute)
    assert built.decoder.recompute.tracker is built.rng_tracker
    # the stage tracker's seed (seed, tp rank) -> the same dropout masks either way
    ids = batches(1)[0]
    outs = []
    for model in (built, by_hand):
        torch.manual_seed(3)
        outs.append(model(ids["tokens"], labels=ids["labels"]))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_pipeline_chunks_share_the_stage_tracker():
    cfg = make_cfg(layers=4, pp=2)
    cfg.parallel.num_virtual_stages_per_pipeline_rank = 2
    state = ParallelState.build(RankGrid(2, pp=2, vpp=2), 1, create_groups=False)
    chunks = build_model_chunks(cfg, state)
    assert len(chunks) == 2 and chunks[0].rng_tracker is chunks[1].rng_tracker
    want = model_parallel_tracker(cfg.training.seed + 100, 0).get_states()   # seed per stage
    got = stage_rng_tracker(cfg, state).get_states()
    for states in (got, chunks[0].rng_tracker.get_states()):
        assert states.keys() == want.keys()
        assert all(torch.equal(states[k]["cpu"], want[k]["cpu"]) for k in want)
    for chunk in chunks:         # each chunk equals the same chunk parallelized on its own
        alone = build_chunk(cfg, state, chunk.pre_process, chunk.post_process,
                            chunk.layer_numbers)
        assert equal_params(params(chunk), params(alone))


# -- the step functions ------------------------------------------------------------------------
def old_loop_forward_step(denom):
    """The forward step the Trainer used to define inline (before models/gpt_step.py)."""
    def step(batch, model):
        output = model(batch["tokens"], batch.get("position_ids"), labels=batch["labels"])

        def loss_func(per_token_loss):
            mask = batch["loss_mask"].to(per_token_loss.dtype)
            total = (per_token_loss.float() * mask).sum()
            return total / denom.to(total.dtype), {"loss_sum": total.detach()}
        return output, loss_func
    return step


def run_step(model, data, step):
    model.zero_grad(set_to_none=True)
    reports = forward_backward_no_pipelining(step, data, [model], None, None)
    return reports, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_gpt_step_is_the_old_inline_step_bitwise():
    cfg, state = make_cfg(), single_rank_state()
    model = build_model(cfg, state)
    data = [get_batch(b, state, "cpu") for b in batches()]
    denom = sum(b["loss_mask"].sum().double() for b in data).reshape(1)
    ctx = StepContext(num_loss_tokens=denom)
    new_reports, new_grads = run_step(model, data, lambda b, m: forward_step(b, m, ctx))
    old_reports, old_grads = run_step(model, data, old_loop_forward_step(denom))
    assert all(torch.equal(a["loss_sum"], b["loss_sum"]) for a, b in zip(new_reports, old_reports))
    assert all(torch.equal(new_grads[n], old_grads[n]) for n in new_grads)


def dummy_term(hidden):
    return COEF * hidden.float().pow(2).mean()


def add_dummy_hooks(chunks):
    """A stand-in for the MoE aux loss: every transformer layer registers a term."""
    handles = []
    for chunk in chunks:
        for layer in chunk.decoder.layers.values():
            handles.append(layer.register_forward_hook(
                lambda _m, _a, out: add_extra_loss("dummy", dummy_term(out))))
    return handles


@pytest.mark.parametrize("recompute", [None, "full"])
def test_extra_loss_adds_scaled_gradient_and_is_logged(recompute):
    cfg, state = make_cfg(recompute=recompute), single_rank_state()
    model = build_model(cfg, state)
    data = [get_batch(b, state, "cpu") for b in batches()]
    denom = sum(b["loss_mask"].sum().double() for b in data).reshape(1)
    scale = 1.0 / len(data)
    plain = StepContext(num_loss_tokens=denom)
    _, base = run_step(model, data, lambda b, m: forward_step(b, m, plain))
    handles = add_dummy_hooks([model])
    ctx = StepContext(num_loss_tokens=denom, extra_loss_names=("dummy",), extra_loss_scale=scale)
    _, with_extra = run_step(model, data, lambda b, m: forward_step(b, m, ctx))
    # the expected effect: scale * d/dtheta of every term, computed on its own
    model.zero_grad(set_to_none=True)
    terms = []
    for b in data:
        with collect_extra_losses(("dummy",)) as extra:
            model(b["tokens"], labels=b["labels"])
        assert len(extra.terms) == cfg.model.num_layers      # once per layer, even recomputed
        terms += [v for _, v in extra.terms]
        (scale * sum(v for _, v in extra.terms)).backward()
    for h in handles:
        h.remove()
    changed = 0
    for name, p in model.named_parameters():
        extra_grad = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(with_extra[name] - base[name], extra_grad,
                                   rtol=1e-4, atol=1e-6)
        changed += bool(extra_grad.abs().max() > 1e-6)
    assert changed > len(base) // 2
    logged = float(ctx.extra_loss_sums[0]) * scale
    assert logged == pytest.approx(float(sum(t.detach() for t in terms)) * scale, rel=1e-6)
    assert logged > 0


def test_extra_loss_channel_rules():
    add_extra_loss("anything", torch.tensor(1.0))        # outside a forward step: dropped
    with collect_extra_losses(("aux",)) as extra:
        with pytest.raises(KeyError, match="not declared"):
            add_extra_loss("other", torch.tensor(1.0))
        with pytest.raises(ValueError, match="scalar"):
            add_extra_loss("aux", torch.ones(2))
        add_extra_loss("aux", torch.tensor(2.0))
    assert [n for n, _ in extra.terms] == ["aux"]
    out = torch.ones(3)
    assert extra.attach(out, 0.5) is out                  # nothing needs grad: unchanged


def test_get_batch_moves_to_device_and_slices_for_cp():
    b = batches(1)[0]
    got = get_batch(b, single_rank_state(), "cpu")
    assert all(torch.equal(got[k], b[k]) for k in b)
    cp_state = ParallelState.build(RankGrid(2, cp=2), 0, create_groups=False)
    seq = b["tokens"].shape[-1]
    got = get_batch(b, cp_state, "cpu")        # chunks 0 and 3 of 4 (context_parallel tests)
    assert got["tokens"].shape[-1] == seq // 2 and got["position_ids"][0, 0] == 0


# -- the loop's use of the family --------------------------------------------------------------
def test_trainer_logs_extra_losses_and_never_mutates_the_config():
    cfg = parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                      "--seq-length", "16", "--mock-data", "--lr", "1e-3", "--tokenizer-type",
                      "ByteLevelTokenizer", "--train-iters", "2", "--global-batch-size", "4",
                      "--micro-batch-size", "2", "--hidden-dropout", "0",
                      "--attention-dropout", "0", "--eval-iters", "0"])
    before = dataclasses.asdict(cfg)
    family = dataclasses.replace(GPT_FAMILY, extra_loss_names=lambda c: ("dummy",))
    trainer = Trainer(cfg, single_rank_state(), "cpu", family)
    trainer.setup()
    assert dataclasses.asdict(cfg) == before and cfg.model.vocab_size is None
    assert trainer.cfg.model.vocab_size == 257 == trainer.tokenizer.vocab_size
    assert resolve_config(trainer.cfg, trainer.tokenizer) is trainer.cfg
    add_dummy_hooks(trainer.model_chunks)
    row = trainer.train_step(trainer.data_iterator(trainer.train_ds, 0))
    assert row["dummy"] > 0 and set(row) == {"lm_loss", "lr", "grad_norm", "dummy"}
