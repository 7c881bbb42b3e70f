"""Pretraining entry: parse flags, start process groups, run the loop."""


def __getattr__(name):
    if name == "main":       # pretrain_gpt.py / pretrain_moe.py: ``from megalite.training import main``
        # start-up time: a training module (the loop, the checkpointer) is imported without the
        # entry and all it reaches (the dry run, the planner, the collective check)
        from megalite.training.entry import main
        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
