"""The mutation map and the sampling tool's own rules (tools/mutation_sample.py; the tool
itself needs cosmic-ray, docs/testing.md): every mapped module and targeted test exists,
every sampled module is mapped and its focus functions exist, and a change is mapped to
its modules."""
import ast
import os
import subprocess
import sys

from mutation_map import MAP, SAMPLE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import mutation_sample as ms  # noqa: E402


def test_every_mapped_module_and_test_exists():
    for module, tests in MAP.items():
        assert os.path.isfile(os.path.join(ROOT, module)), module
        assert tests, module
        for t in tests:
            assert os.path.isfile(os.path.join(ROOT, t.split("::")[0])), (module, t)


def test_every_sampled_module_is_mapped_and_its_functions_exist():
    for module, functions in SAMPLE.items():
        assert module in MAP, module
        if functions is None:
            continue
        tree = ast.parse(open(os.path.join(ROOT, module)).read())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert set(functions) <= defined, (module, set(functions) - defined)
        assert ms.focus_lines(os.path.join(ROOT, module), functions)


def test_the_test_command_runs_only_the_targeted_tests_that_exist(tmp_path):
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / "test_moe.py").write_text("")
    cmd = ms.test_command("megalite/moe/router.py", str(tmp_path), "PY")
    assert cmd == "PY -m pytest -x -q -p no:cacheprovider tests/unit/test_moe.py"
    assert ms.test_command("megalite/elastic/relayout.py", str(tmp_path), "PY") == ""


def test_a_change_maps_to_its_modules_and_an_unmapped_one_is_named(capsys):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    assert all(m.startswith("megalite/") and m.endswith(".py")
               for m in ms.changed_modules(head))
    assert ms.main(["--modules", "megalite/not_mapped.py"]) == 2
    assert "unmapped: megalite/not_mapped.py" in capsys.readouterr().out
