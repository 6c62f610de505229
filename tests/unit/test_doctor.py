"""``stagebuf doctor``: a setting that cannot work here is explained, never a traceback."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stagebuf
from helpers import invoke, no_accelerator
from stagebuf import Tier, capabilities
from stagebuf import _doctor as doctor_mod
from stagebuf._cli import main

SRC = str(Path(__file__).resolve().parents[2] / "src")
HAS_CUDA = torch.cuda.is_available()
TIERS = "uva, pinned, pageable, host"


BUILDS = [
    pytest.param(None, "torch is a CPU build", "install a CUDA build of torch", id="cpu-build"),
    pytest.param("13.0", "torch is a CUDA build but sees no driver or GPU", "nvidia-smi", id="cuda-build"),
]


def doctor(*args: str, env: dict[str, str] | None = None):
    return invoke(main, ["doctor", *args], env=env)


def assert_explained(result, *texts: str) -> None:
    assert result.exit_code == 2, result.output
    assert (
        "Traceback" not in result.output
        and result.exception is None
        or isinstance(result.exception, SystemExit)
    )
    for t in texts:
        assert t in result.output, f"{t!r} not in:\n{result.output}"


def doctor_json(*args: str, env: dict[str, str] | None = None) -> dict:
    r = doctor("--json", *args, env=env)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    return json.loads(r.stdout)


# --- through the command line's main() ---------------------------------------------------------------


@pytest.mark.parametrize(("cuda", "cause", "fix"), BUILDS)
@pytest.mark.parametrize("tier", ["uva", "pinned"])
def test_forced_accelerator_tier_without_one(monkeypatch, cuda, cause, fix, tier):
    no_accelerator(monkeypatch, cuda)
    r = doctor(env={"STAGEBUF_TIER": tier})
    assert_explained(
        r,
        f"STAGEBUF_TIER={tier} cannot work on this machine",
        cause,
        "allowed      host, pageable",
        "unset STAGEBUF_TIER",
        fix,
    )
    j = doctor_json(env={"STAGEBUF_TIER": tier})
    assert j["setting"] == "STAGEBUF_TIER" and j["value"] == tier and cause in j["error"]
    assert j["allowed"] == ["host", "pageable"] and "unset STAGEBUF_TIER" in j["fix"] and fix in j["fix"]
    assert j["torch_build"] == ("CPU build" if cuda is None else "CUDA 13.0 build")
    assert j["cuda_available"] is False


@pytest.mark.parametrize("value", ["garbage", "UVA!", "1"])
def test_unknown_tier(value):
    r = doctor(env={"STAGEBUF_TIER": value})
    assert_explained(
        r,
        f"STAGEBUF_TIER={value} cannot work",
        f"STAGEBUF_TIER={value!r} is not a tier",
        f"allowed      {TIERS}",
        "unset STAGEBUF_TIER",
    )
    j = doctor_json(env={"STAGEBUF_TIER": value})
    assert j["error"] == f"STAGEBUF_TIER={value!r} is not a tier" and j["allowed"] == TIERS.split(", ")
    assert "unset STAGEBUF_TIER" in j["fix"]


@pytest.mark.parametrize(("cuda", "cause", "fix"), BUILDS)
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_device_without_a_gpu(monkeypatch, cuda, cause, fix, device):
    no_accelerator(monkeypatch, cuda)
    r = doctor("--device", device)
    assert_explained(
        r,
        f"--device {device} cannot work",
        f"--device {device} cannot be used: {cause}",
        "allowed      (omit --device), cpu",
        "omit --device",
        fix,
    )
    build = "CPU build" if cuda is None else "CUDA 13.0 build (sees no driver or GPU)"
    assert f"torch build  {build}" in r.output
    j = doctor_json("--device", device)
    assert j["setting"] == "--device" and j["value"] == device and cause in j["error"]
    assert j["allowed"] == ["(omit --device)", "cpu"] and "omit --device" in j["fix"] and fix in j["fix"]


@pytest.mark.parametrize("device", ["banana", "gpu9", "cuda:x", "meta"])
def test_unknown_device(device):
    r = doctor("--device", device)
    assert_explained(
        r, f"--device {device} cannot work", "omit --device", "allowed      (omit --device), cpu"
    )
    j = doctor_json("--device", device)
    assert j["setting"] == "--device" and j["value"] == device and device in j["error"]
    assert "cpu" in j["allowed"] and "omit --device" in j["fix"]


def test_tier_error_comes_first_when_both_are_wrong():
    r = doctor("--device", "banana", env={"STAGEBUF_TIER": "garbage"})
    assert_explained(r, "STAGEBUF_TIER='garbage' is not a tier")


@pytest.mark.parametrize(("cuda", "cause", "fix"), BUILDS)
def test_report_names_the_torch_build(monkeypatch, cuda, cause, fix):
    no_accelerator(monkeypatch, cuda)
    r = doctor()
    assert r.exit_code == 0, r.output
    build = "CPU build" if cuda is None else "CUDA 13.0 build (sees no driver or GPU)"
    flat = " ".join(r.output.translate(str.maketrans("", "", "│┃")).split())  # rich wraps long cells
    assert "torch build" in flat and build in flat and cause in flat and fix in flat
    caps = capabilities()
    j = json.loads(doctor("--json").stdout)
    assert j.pop("vllm")["installed"] in (True, False)  # vLLM and the plugin: tests/unit/test_vllm_plugin.py
    assert j == json.loads(json.dumps(caps.as_dict()))
    assert j["torch_build"] == ("CPU build" if cuda is None else "CUDA 13.0 build")
    assert cause in j["cpu_cause"] and j["tier"] == "HOST"


@pytest.mark.parametrize(
    ("command", "where"),
    [("bench", "python -m benchmarks"), ("demo", "examples/demo.py")],
)
def test_commands_that_moved_out_say_where(command, where):
    """The bench and the demo live in the checkout (benchmarks/, examples/), not in the package."""
    for args in ([command], ["-v", command, "--quick"]):
        r = invoke(main, args)
        assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output
        assert "Traceback" not in r.output
        assert f"{command!r} is not a command (allowed: doctor)" in r.stderr and where in r.stderr


def test_an_unknown_command_names_the_allowed_ones():
    r = invoke(main, ["frobnicate"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert "invalid choice" in r.stderr and "frobnicate" in r.stderr and "doctor" in r.stderr


# --- examples/demo.py, in a real process ---------------------------------------------------------

DEMO = str(Path(__file__).resolve().parents[2] / "examples" / "demo.py")
DEMO_STEP = re.compile(
    r"^step (\d+): block-table edits (\[.*\]); requests (\[.*\]) at positions (\[.*\]) "
    r"-> slots (\[.*\]): (ok|MISMATCH.*)$"
)


@pytest.mark.parametrize("tier", ["host", "pageable"])
def test_demo_slots_match_a_replay_of_its_edits(tier):
    """Replays the block-table edits the demo prints into a plain-Python table; the slots the device
    computed must be table[req][pos // 4] * 4 + pos % 4 for the requests and positions it printed."""
    steps = 40
    p = _run([DEMO, "--steps", str(steps)], {"STAGEBUF_TIER": tier})
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith(f"tier {tier.upper()} on cpu: ")
    table = [[0] * 8 for _ in range(6)]
    seen = renewed = 0
    for line in lines:
        m = DEMO_STEP.match(line)
        if not m:
            continue
        assert int(m[1]) == seen and m[6] == "ok", line
        for row, start, ids in ast.literal_eval(m[2]):
            renewed += seen > 0 and start == 0  # a new request took a finished one's row
            table[row][start : start + len(ids)] = ids
        req, pos, slots = (ast.literal_eval(m[i]) for i in (3, 4, 5))
        assert len(req) == len(pos) == len(slots) == 4 and len(set(req)) == 4
        assert slots == [table[r][q // 4] * 4 + q % 4 for r, q in zip(req, pos)], line
        seen += 1
    assert seen == steps and renewed > 0
    last = lines[-1]
    assert last.startswith(f"tier {tier.upper()}: {steps} steps") and "every device result matches" in last
    if tier == "pageable":  # one transfer per step: both arrays of a step move together
        assert f"with {steps} host-to-device transfers" in last


def test_demo_explains_a_setting_that_cannot_work():
    p = _run([DEMO], {"STAGEBUF_TIER": "garbage"})
    assert p.returncode == 2 and "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    assert "STAGEBUF_TIER='garbage' is not a tier" in p.stdout and TIERS in p.stdout
    assert "stagebuf doctor" in p.stdout and "step 0" not in p.stdout


# --- the plain-text report, and doctor without rich -------------------------------------------


def test_render_text_holds_every_fact(cpu_tier):
    caps = capabilities("cpu")
    text = doctor_mod.render_text(caps)
    lines = text.splitlines()
    assert lines[0] == "stagebuf doctor"

    def value(item: str) -> str:
        (line,) = [ln for ln in lines if ln.strip().startswith(item + "  ")]
        return line.strip()[len(item) :].strip()

    assert value("chosen tier") == caps.tier.name == cpu_tier.name
    assert value("torch") == torch.__version__
    assert value("device") == str(caps.device)
    assert value("pinned memory") == "no" and value("UVA probe") == "not available"
    assert value("forced by STAGEBUF_TIER") == cpu_tier.name.lower()
    for reason in caps.reasons:
        assert f"  - {reason}" in lines
    assert not set(text) & set("┏┃━│")


def test_doctor_without_rich_prints_plain_text(monkeypatch):
    for name in [m for m in sys.modules if m == "rich" or m.startswith("rich.")] + ["rich"]:
        monkeypatch.setitem(sys.modules, name, None)  # `import rich...` now raises ImportError
    r = doctor()
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == doctor_mod.render_text(capabilities()).strip()


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("STAGEBUF_TIER", None)
    return {**env, **extra}


def _run(args: list[str], env_extra: dict[str, str], code: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", code] if code else [sys.executable, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(env_extra), timeout=120)


def _run_both(args: list[str], env_extra: dict[str, str]) -> list[tuple[int, str, str]]:
    """``python3 args`` and ``python3 args --json``, side by side: (status, stdout, stderr) each."""
    procs = [
        subprocess.Popen(
            [sys.executable, *a],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(env_extra),
        )
        for a in (args, [*args, "--json"])
    ]
    out = []
    for p in procs:
        so, se = p.communicate(timeout=120)
        out.append((p.returncode, so, se))
    return out


def test_subprocess_without_rich():
    code = "import sys; sys.modules['rich'] = None\nfrom stagebuf._cli import main\nmain(['doctor'])"
    p = _run([], {}, code)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "torch build" in p.stdout and "chosen tier" in p.stdout and not set(p.stdout) & set("┏┃━│")
    (tier_line,) = [ln for ln in p.stdout.splitlines() if ln.strip().startswith("chosen tier")]
    assert tier_line.split()[-1] in {t.name for t in Tier}


# --- through a real process: python3 -m stagebuf doctor --------------------------------------


@pytest.mark.parametrize(
    ("args", "env", "texts"),
    [
        (["doctor"], {"STAGEBUF_TIER": "garbage"}, ["STAGEBUF_TIER='garbage' is not a tier", TIERS, "fix"]),
        (
            ["doctor", "--device", "banana"],
            {},
            ["--device banana is not a device torch can use", "omit --device"],
        ),
        pytest.param(
            ["doctor"],
            {"STAGEBUF_TIER": "uva"},
            ["STAGEBUF_TIER=uva needs an accelerator", "host, pageable", "unset STAGEBUF_TIER"],
            marks=pytest.mark.skipif(HAS_CUDA, reason="UVA may work here"),
        ),
        pytest.param(
            ["doctor", "--device", "cuda"],
            {},
            ["--device cuda cannot be used: torch is a", "omit --device"],
            marks=pytest.mark.skipif(HAS_CUDA, reason="CUDA works here"),
        ),
    ],
)
def test_real_process(args, env, texts):
    (rc, so, se), (rcj, soj, sej) = _run_both(["-m", "stagebuf", *args], env)
    assert rc == 2, so + se
    assert "Traceback" not in so + se
    for t in texts:
        assert t in so
    assert rcj == 2 and "Traceback" not in soj + sej
    j = json.loads(soj)
    assert texts[0] in j["error"] and j["fix"] and j["allowed"]


def test_real_process_with_torch_and_numpy_only():
    """Neither click nor rich nor matplotlib: the command line still explains (plain text)."""
    code = (
        "import sys\nfor m in ('click', 'rich', 'matplotlib'): sys.modules[m] = None\n"
        "from stagebuf._cli import main\nraise SystemExit(main(['doctor', '--device', 'banana']))"
    )
    p = _run([], {}, code)
    assert p.returncode == 2 and "Traceback" not in p.stdout + p.stderr
    assert "--device banana is not a device torch can use" in p.stdout


@pytest.mark.parametrize(
    "setting, value, allowed",
    [
        ("STAGEBUF_CHECK", "false", "0, 1"),
        ("STAGEBUF_CHECK", "no", "0, 1"),
        ("STAGEBUF_CHECK", "2", "0, 1"),
        ("STAGEBUF_WRITE_KERNEL", "cuda", "auto, scatter, triton"),
        ("STAGEBUF_CHECK_QUARANTINE", "-1", "an int >= 0"),
        ("STAGEBUF_CHECK_QUARANTINE", "many", "an int >= 0"),
        ("STAGEBUF_CHECK_QUARANTINE", "1.5", "an int >= 0"),
        ("STAGEBUF_WSL_PIN_MEMORY", "maybe", "0, 1"),
    ],
)
def test_bad_settings_are_refused_at_start_up(monkeypatch, setting, value, allowed):
    """STAGEBUF_CHECK and STAGEBUF_WRITE_KERNEL are checked by the first probe, strictly, and doctor
    explains them on one screen (exit 2, no traceback), in text and JSON."""
    monkeypatch.setenv(setting, value)
    stagebuf.reset_capabilities()
    with pytest.raises(stagebuf.SetupError, match=f"{setting}={value!r}") as e:
        stagebuf.capabilities()
    assert (
        isinstance(e.value, ValueError)
        and e.value.setting == setting
        and ", ".join(e.value.allowed) == allowed
    )
    monkeypatch.delenv(setting)
    assert_explained(doctor(env={setting: value}), setting, allowed)
    j = doctor_json(env={setting: value})
    assert j["setting"] == setting and j["value"] == value and ", ".join(j["allowed"]) == allowed


@pytest.mark.parametrize("value, shown", [(None, "off"), ("0", "off"), ("", "off"), ("1", "check mode on")])
def test_doctor_reports_check_mode(value, shown):
    env = {} if value is None else {"STAGEBUF_CHECK": value}
    r = doctor(env=env)
    assert r.exit_code == 0
    line = next(ln for ln in r.stdout.splitlines() if "STAGEBUF_CHECK " in ln)
    assert line.replace("│", " ").split()[-1] == shown.split()[-1]
    assert any("STAGEBUF_WRITE_KERNEL" in ln and "auto" in ln for ln in r.stdout.splitlines())


@pytest.mark.parametrize("value, shown", [(None, "16"), ("0", "0"), ("64", "64")])
def test_doctor_reports_the_quarantine(value, shown):
    env = {} if value is None else {"STAGEBUF_CHECK_QUARANTINE": value}
    r = doctor(env=env)
    assert r.exit_code == 0
    line = next(ln for ln in r.stdout.splitlines() if "STAGEBUF_CHECK_QUARANTINE" in ln)
    assert f" {shown} (check mode" in line


@pytest.mark.parametrize(
    "setting, value", [("STAGEBUF_WRITE_KERNEL", "x"), ("STAGEBUF_CHECK_QUARANTINE", "-1")]
)
def test_a_bad_setting_names_its_allowed_values_once(monkeypatch, setting, value):
    monkeypatch.setenv(setting, value)
    stagebuf.reset_capabilities()
    with pytest.raises(stagebuf.SetupError) as e:
        stagebuf.capabilities()
    assert str(e.value).count("allowed:") == 1
