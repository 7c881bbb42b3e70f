"""Direct assertions on the structure's new homes (the loss policy, ParallelDims, the
activation registry, the rule engine's relations, validation's layout checks), each at a
setting where a plausible slip changes the value -- the survivors of a mutation sample
(docs/testing.md, "Mutation sampling") turned into closed forms."""
import pytest
import torch

from megalite.cli.arguments import parse_args
from megalite.config import ConfigError
from megalite.config.parallel_dims import ParallelDims
from megalite.config import activations
from megalite.transformer.loss_reduction import micro_batch_loss

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--mock-data", "--vocab-size", "1000", "--train-iters", "2",
        "--lr", "1e-3"]


def _refusal(argv) -> str:
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    return str(err.value)


def test_a_loss_scale_below_one_multiplies_too():
    loss = micro_batch_loss(torch.tensor(6.0), torch.tensor(4), 0.5)
    assert float(loss) == pytest.approx(6.0 / 4 * 0.5)
    assert float(micro_batch_loss(torch.tensor(6.0), torch.tensor(4), 1.0)) == 1.5


def test_hybrid_instances_that_divide_dp_times_cp_fit():
    assert ParallelDims(world=4, cp=2, dp_instances=4).problem() is None      # dp 2 x cp 2
    assert "instances do not divide" in ParallelDims(world=6, cp=3, dp_instances=4).problem()


@pytest.mark.parametrize("hidden,ffn", [(4096, 10944), (100, 320), (64, 192)])
def test_llama_default_ffn_is_two_thirds_of_4h_rounded_up_to_64(hidden, ffn):
    assert activations.ACTIVATIONS["swiglu"].default_ffn(hidden) == ffn


def test_switches_turn_on_only_the_chosen_activation():
    swiglu = activations.switches(activations.ACTIVATIONS["swiglu"])
    assert swiglu["swiglu"] is True and sum(swiglu.values()) == 1
    gelu = activations.switches(activations.ACTIVATIONS["gelu"])    # the default: no switch
    assert not any(gelu.values())


def test_all_to_all_cp_message_names_tp_times_cp():
    msg = _refusal(["--world-size", "4", *BASE, "--context-parallel-size", "4",
                    "--cp-comm-type", "a2a", "--group-query-attention",
                    "--num-query-groups", "2"])
    assert "divisible by TP x CP (4)" in msg, msg


def test_two_hybrid_instances_that_do_not_split_dp_are_refused():
    msg = _refusal(["--world-size", "3", *BASE, "--global-batch-size", "3",
                    "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"])
    assert msg.startswith("--num-distributed-optimizer-instances (2) must divide"), msg


def test_account_flags_without_pipeline_say_need_or_needs():
    one = _refusal(["--world-size", "1", *BASE, "--account-for-embedding-in-pipeline-split"])
    assert one.startswith("--account-for-embedding-in-pipeline-split needs "), one
    both = _refusal(["--world-size", "1", *BASE, "--account-for-embedding-in-pipeline-split",
                     "--account-for-loss-in-pipeline-split"])
    assert " and --account-for-loss-in-pipeline-split need --pipeline" in both, both


def test_accounted_slots_must_split_over_pp_times_virtual_stages():
    # 4 layers + embedding + loss = 6 slots: not a multiple of PP 2 x 2 virtual stages
    msg = _refusal(["--world-size", "2", *BASE, "--global-batch-size", "4",
                    "--pipeline-model-parallel-size", "2",
                    "--num-virtual-stages-per-pipeline-rank", "2",
                    "--account-for-embedding-in-pipeline-split",
                    "--account-for-loss-in-pipeline-split"])
    assert "= 6 pipeline layers are not divisible by --pipeline-model-parallel-size (2) x " \
        "virtual stages (2)" in msg, msg


def test_global_batch_message_names_micro_times_dp():
    msg = _refusal(["--world-size", "2", *BASE, "--micro-batch-size", "2",
                    "--global-batch-size", "6"])
    assert msg.endswith("make it a multiple of 4"), msg


def test_learned_positions_shorter_than_the_sequence_are_refused_only_then():
    flags = ["--world-size", "1", *BASE, "--global-batch-size", "1",
             "--position-embedding-type", "learned_absolute"]
    assert "is smaller than --seq-length (32)" in _refusal(
        flags + ["--max-position-embeddings", "16"])
    assert parse_args(flags + ["--max-position-embeddings", "32"]).model.seq_length == 32
