"""tools/checkpoint/convert.py with Ctrl-C injected by the test, for
tests/e2e/test_user_errors_e2e.py.

    python tests/e2e/convert_hooks.py HOOK [convert.py flags]

HOOK is one of
  sigint-in-read    Ctrl-C (SIGINT to this process) while a safetensors file is read
  sigint-in-write   Ctrl-C while the converted checkpoint's files are written (DCP for a
                    megalite target, model.safetensors for a Hugging Face one)

The hooks patch library functions from outside; the converter has no test hooks.
"""
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools", "checkpoint"))


def _ctrl_c_inside(owner, name: str) -> None:
    """``owner.name`` sends SIGINT to this process once it is running, as a user's Ctrl-C."""
    original = getattr(owner, name)

    def patched(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)                 # the handler runs here, inside the call
        return original(*args, **kwargs)
    setattr(owner, name, patched)


def main() -> int:
    hook, argv = sys.argv[1], sys.argv[2:]
    if hook == "sigint-in-read":
        import safetensors.torch

        _ctrl_c_inside(safetensors.torch, "load_file")
    elif hook == "sigint-in-write":
        import safetensors.torch
        import torch.distributed.checkpoint as dcp

        _ctrl_c_inside(dcp.FileSystemWriter, "write_data")
        _ctrl_c_inside(safetensors.torch, "save_file")
    else:
        raise SystemExit(f"unknown hook {hook!r}")
    import convert

    return convert.main(argv)


if __name__ == "__main__":
    sys.exit(main())
