"""pretrain_gpt.py with one fault injected by the test, for tests/e2e/test_user_errors_e2e.py.

    python tests/e2e/user_error_hooks.py HOOK [pretrain_gpt.py flags]

HOOK is one of
  rankN-data-error   rank N raises a DataError at iteration 2 (its peers are in a collective)
  sigint-in-save     Ctrl-C (SIGINT to this process) while the second checkpoint's files are
                     being written
  sigint-in-train    Ctrl-C during iteration 3
  bug-at-iteration-2 a RuntimeError at iteration 2 (a bug: keeps its traceback)

The hooks patch megalite's functions from outside; megalite itself has no test hooks.
"""
import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def _patch_train_step(at_iteration: int, action) -> None:
    from megalite.training.loop import Trainer

    original = Trainer.train_step

    def train_step(self, iterator):
        if self.iteration + 1 == at_iteration:
            action(self)
        return original(self, iterator)
    Trainer.train_step = train_step


def _data_error_on(rank: int):
    def action(trainer) -> None:
        _data_error(trainer, rank)
    return action


def _data_error(trainer, rank: int) -> None:
    from megalite.errors import DataError

    if trainer.state.rank == rank:
        raise DataError("injected: corpus.bin: token id 512 at position 7 is outside the "
                        "vocabulary (size 100)")


def _bug(trainer) -> None:
    raise RuntimeError("injected bug")


def _sigint_in_save() -> None:
    import torch.distributed.checkpoint as dcp

    original = dcp.FileSystemWriter.write_data
    calls = {"n": 0}

    def write_data(self, plan, planner):
        calls["n"] += 1
        if calls["n"] == 2:               # the second checkpoint: the first stays complete
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, plan, planner)
    dcp.FileSystemWriter.write_data = write_data


def main() -> int:
    # Ctrl-C as at a terminal: a shell without job control (a CI script's background job)
    # starts its children with SIGINT ignored, and Python then installs no handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
    hook, argv = sys.argv[1], sys.argv[2:]
    if hook.startswith("rank") and hook.endswith("-data-error"):
        _patch_train_step(2, _data_error_on(int(hook[4:-len("-data-error")])))
    elif hook == "sigint-in-save":
        _sigint_in_save()
    elif hook == "sigint-in-train":
        _patch_train_step(3, lambda t: os.kill(os.getpid(), signal.SIGINT))
    elif hook == "bug-at-iteration-2":
        _patch_train_step(2, _bug)
    else:
        raise SystemExit(f"unknown hook {hook}")
    from megalite.training.entry import main as pretrain_main

    return pretrain_main(argv)


if __name__ == "__main__":
    sys.exit(main())
