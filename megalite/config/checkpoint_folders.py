"""What a folder given to ``--load`` holds, without torch: the names of a megalite run's
folder (the latest marker, ``iter_NNNNNNN`` iterations; ``checkpointing/manifest.py`` writes
and checks them) and of a Hugging Face one (config.json + safetensors), with the one line that tells a user who passes a
Hugging Face folder to ``--load`` to convert it first (the training format is DCP;
``tools/checkpoint/convert.py`` writes it).  The ``--load`` domain check reads it before
any process group."""
from __future__ import annotations

import os
import re
import shlex
from typing import List, Optional

MARKER = "latest_checkpointed_iteration.txt"     # the latest complete iteration, written last
ITERATION = re.compile(r"^iter_(\d{7,})$")      # one iteration's folder


def iteration_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


def weight_files(directory: str) -> List[str]:
    """The safetensors names a Hugging Face folder holds (empty when it holds none)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(n for n in names if n.endswith(".safetensors") or n == WEIGHTS_INDEX)


def is_hf_checkpoint(directory: str) -> bool:
    """config.json beside safetensors weights, and no megalite marker."""
    return (os.path.isfile(os.path.join(directory, CONFIG)) and bool(weight_files(directory))
            and not os.path.isfile(os.path.join(directory, MARKER)))


def not_converted_problem(flag: str, directory: str) -> Optional[str]:
    """The line for a Hugging Face folder given where a megalite checkpoint belongs, or None."""
    if not is_hf_checkpoint(directory):
        return None
    target = os.path.normpath(directory) + "-megalite"
    cmd = ["python", "tools/checkpoint/convert.py", "--source-format", "hf",
           "--target-format", "megalite", "--load-dir", directory, "--save-dir", target]
    return f"{flag}: '{directory}' is a Hugging Face checkpoint (config.json + safetensors), " \
           f"not a megalite one; convert it first: {' '.join(map(shlex.quote, cmd))}, then " \
           f"{flag} {shlex.quote(target)} --use-checkpoint-args"


# -- what a Hugging Face folder holds beside the weights (kept through a conversion) --------
