"""``stagebuf doctor``: a setting that cannot work here is explained, never a traceback."""

from __future__ import annotations

import ast
import io
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
from stagebuf._tools import doctor as doctor_mod
from stagebuf._tools.cli import main

SRC = str(Path(__file__).resolve().parents[2] / "src")
HAS_CUDA = torch.cuda.is_available()
TIERS = "uva, pinned, pageable, host"


BUILDS = [
    pytest.param(None, "torch is a CPU build", "install a CUDA build of torch", id="cpu-build"),
    pytest.param("13.0", "torch is a CUDA build but sees no driver or GPU", "nvidia-smi", id="cuda-build"),
]


def doctor(*args: str, env: dict[str, str] | None = None, plain: bool = False):
    """``stagebuf doctor args`` in this process; ``plain``: the plain-text report (one line per row)."""
    if plain:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(doctor_mod, "_rich", lambda: None)
            return invoke(main, ["doctor", *args], env=env)
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
    assert j.pop("nanovllm")["tested_versions"] == ["nano-vllm-fork 20260210"]  # tests/unit/test_nanovllm.py
    assert j.pop("stagebuf") == stagebuf.__version__ and len(j.pop("settings")) == len(_setting_names())
    assert j == json.loads(json.dumps(caps.as_dict()))
    assert j["torch_build"] == ("CPU build" if cuda is None else "CUDA 13.0 build")
    assert cause in j["cpu_cause"] and j["tier"] == "HOST"


@pytest.mark.parametrize("command", ["frobnicate", "bench", "demo"])
def test_an_unknown_command_names_the_allowed_ones(command):
    """Any command but doctor is argparse's usage error (the bench and the demo live in the checkout)."""
    for args in ([command], ["-v", command, "--quick"]):
        r = invoke(main, args)
        assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output
        assert "Traceback" not in r.output
        assert f"argument COMMAND: invalid choice: {command!r} (choose from " in r.stderr, r.stderr
        assert "doctor" in r.stderr and "is not a command" not in r.stderr


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
    code = "import sys; sys.modules['rich'] = None\nfrom stagebuf._tools.cli import main\nmain(['doctor'])"
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
        "from stagebuf._tools.cli import main\nraise SystemExit(main(['doctor', '--device', 'banana']))"
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
        ("STAGEBUF_CHECK_QUARANTINE", "-1", "an int in [0, 1024]"),
        ("STAGEBUF_CHECK_QUARANTINE", "many", "an int in [0, 1024]"),
        ("STAGEBUF_CHECK_QUARANTINE", "1.5", "an int in [0, 1024]"),
        ("STAGEBUF_CHECK_QUARANTINE", "99999999999", "an int in [0, 1024]"),
        ("STAGEBUF_CHECK_QUARANTINE", "1025", "an int in [0, 1024]"),
        ("STAGEBUF_CHECK_QUARANTINE", "²", "an int in [0, 1024]"),
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


@pytest.mark.parametrize("value, shown", [(None, "off"), ("0", "off"), ("", "off"), ("1", "on")])
def test_doctor_reports_check_mode(value, shown):
    env = {} if value is None else {"STAGEBUF_CHECK": value}
    r = doctor(env=env)
    assert r.exit_code == 0
    line = next(ln for ln in r.stdout.splitlines() if "STAGEBUF_CHECK " in ln)
    assert f"(check mode {shown})" in line
    assert any("STAGEBUF_WRITE_KERNEL" in ln and "auto" in ln for ln in r.stdout.splitlines())


@pytest.mark.parametrize("value, shown", [(None, "16"), ("0", "0"), ("64", "64"), ("1024", "1024")])
def test_doctor_reports_the_quarantine(value, shown):
    """Its value, its limit and what it costs in memory."""
    env = {} if value is None else {"STAGEBUF_CHECK_QUARANTINE": value}
    r = doctor(env=env, plain=True)
    assert r.exit_code == 0
    line = next(ln for ln in r.stdout.splitlines() if "STAGEBUF_CHECK_QUARANTINE" in ln)
    assert f" {shown} (check mode" in line
    assert "at most 1024" in line and f"{shown} MiB more for a 1 MiB StepStager" in line


@pytest.mark.parametrize(
    "setting, value", [("STAGEBUF_WRITE_KERNEL", "x"), ("STAGEBUF_CHECK_QUARANTINE", "-1")]
)
def test_a_bad_setting_names_its_allowed_values_once(monkeypatch, setting, value):
    monkeypatch.setenv(setting, value)
    stagebuf.reset_capabilities()
    with pytest.raises(stagebuf.SetupError) as e:
        stagebuf.capabilities()
    assert str(e.value).count("allowed:") == 1


def test_a_bad_quarantine_says_its_limit_and_memory_cost(monkeypatch):
    monkeypatch.setenv("STAGEBUF_CHECK_QUARANTINE", "999999")
    stagebuf.reset_capabilities()
    with pytest.raises(stagebuf.SetupError) as e:
        stagebuf.capabilities()
    msg = str(e.value)
    assert "[0, 1024]" in msg and "1024 extra slots" in msg and "1 MiB StepStager" in msg, msg


# --- what doctor shows: its version, every setting, the vLLM plugin's plan -----------------------------


def test_version_is_shown_and_printed():
    r = doctor(plain=True)
    assert r.exit_code == 0
    (line,) = [ln for ln in r.stdout.splitlines() if ln.strip().startswith("stagebuf  ")]
    assert line.split()[-1] == stagebuf.__version__
    j = json.loads(doctor("--json").stdout)
    assert j["stagebuf"] == stagebuf.__version__
    for flag in ("--version", "-V"):
        v = invoke(main, [flag])
        assert v.exit_code == 0 and v.stdout.strip() == f"stagebuf {stagebuf.__version__}", v.output
    p = _run(["-m", "stagebuf", "--version"], {})
    assert p.returncode == 0 and p.stdout.strip() == f"stagebuf {stagebuf.__version__}", p.stderr


def _setting_names() -> list[str]:
    from stagebuf._tiers import settings as _constants

    return [v for k, v in vars(_constants).items() if k.startswith("ENV_") and isinstance(v, str)]


def test_every_setting_is_in_the_text_and_the_json():
    names = _setting_names()
    assert {"STAGEBUF_TIER", "STAGEBUF_CHECK", "STAGEBUF_CHECK_QUARANTINE", "STAGEBUF_WRITE_KERNEL"} <= set(
        names
    )
    env = {"STAGEBUF_CHECK": "1", "STAGEBUF_CHECK_QUARANTINE": "3", "STAGEBUF_WRITE_KERNEL": "scatter"}
    text = doctor(env=env, plain=True).stdout
    for n in names:
        assert n in text, n
    j = json.loads(doctor("--json", env=env).stdout)
    by_name = {s["name"]: s for s in j["settings"]}
    assert set(by_name) == set(names)
    assert by_name["STAGEBUF_CHECK"]["value"] == "1" and by_name["STAGEBUF_CHECK"]["effective"] == "1"
    assert by_name["STAGEBUF_CHECK_QUARANTINE"]["effective"] == "3"
    assert by_name["STAGEBUF_WRITE_KERNEL"]["value"] == "scatter"
    assert by_name["STAGEBUF_TIER"]["value"] is None and by_name["STAGEBUF_TIER"]["effective"] == "auto"


def test_the_plugin_rows_show_every_key_of_the_plan(monkeypatch):
    """doctor renders whatever ``plan().as_dict()`` holds, in the text and the JSON."""
    from stagebuf._engines import vllm as _vllm

    real = _vllm.plan

    class Wider:
        def __init__(self, p):
            self.p = p

        def as_dict(self):
            return {**self.p.as_dict(), "mode": "step", "patches": ["a", "b"]}

    monkeypatch.setattr(_vllm, "plan", lambda *a, **k: Wider(real(*a, **k)))
    text = doctor(plain=True).stdout
    assert re.search(r"vLLM plugin mode +step", text) and re.search(r"vLLM plugin patches +a, b", text), text
    assert re.search(r"vLLM plugin action +off", text)
    rep = json.loads(doctor("--json").stdout)["vllm"]
    assert rep["mode"] == "step" and rep["patches"] == ["a", "b"] and rep["action"] == "off"


@pytest.mark.parametrize("value", ["2", "yes", "true"])
def test_a_bad_vllm_setting_is_explained_with_exit_2(value):
    r = doctor(env={"STAGEBUF_VLLM": value})
    assert_explained(r, f"STAGEBUF_VLLM={value} cannot work", f"STAGEBUF_VLLM={value!r}", "allowed", "0, 1")
    j = doctor_json(env={"STAGEBUF_VLLM": value})
    assert j["setting"] == "STAGEBUF_VLLM" and j["value"] == value and "0" in j["allowed"]


@pytest.mark.parametrize("as_json", [False, True])
def test_a_reader_that_closes_the_pipe_gets_no_traceback(as_json):
    """``stagebuf doctor | head -1``: the reader is gone before doctor prints (closed at once here)."""
    args = [sys.executable, "-m", "stagebuf", "doctor"] + (["--json"] if as_json else [])
    r, w = os.pipe()
    p = subprocess.Popen(args, stdout=w, stderr=subprocess.PIPE, text=True, env=_env({}))
    os.close(w)
    os.close(r)  # nothing reads: every write doctor makes meets a closed pipe
    _, err = p.communicate(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert p.returncode == 0, err


def test_the_triton_kernel_on_the_cpu_is_explained(monkeypatch, caplog):
    """STAGEBUF_WRITE_KERNEL=triton cannot apply on tier HOST: the probe says why (a reason, one log line),
    and doctor shows the kernel in use."""
    monkeypatch.setenv("STAGEBUF_WRITE_KERNEL", "triton")
    stagebuf.reset_capabilities()
    with caplog.at_level("WARNING", logger="stagebuf"):
        caps = capabilities("cpu")
        stagebuf.StagedWriteTensor(4, torch.int32, "cpu")
    assert caps.tier is Tier.HOST
    said = [r.getMessage() for r in caplog.records if "STAGEBUF_WRITE_KERNEL=triton" in r.getMessage()]
    assert len(said) == 1 and "numpy assignment" in said[0]
    assert any("STAGEBUF_WRITE_KERNEL=triton does not apply" in r for r in caps.reasons)
    monkeypatch.delenv("STAGEBUF_WRITE_KERNEL")
    r = doctor(env={"STAGEBUF_WRITE_KERNEL": "triton", "STAGEBUF_TIER": "host"}, plain=True)
    assert r.exit_code == 0
    line = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("STAGEBUF_WRITE_KERNEL"))
    assert "in use: host" in line and "numpy assignment" in line, line


def test_a_device_torch_has_no_backend_for_is_explained(caplog):
    """``device='xla'`` without torch_xla: torch parses the name but cannot allocate there."""
    if torch.device("xla").type == "xla" and _xla_works():
        pytest.skip("torch has an xla backend here")
    with caplog.at_level("WARNING", logger="stagebuf"), pytest.raises(stagebuf.TierUnavailableError) as e:
        stagebuf.UvaBufferPool(4, torch.int32, device="xla")
    assert "no xla backend" in str(e.value) and "allowed: " in str(e.value), str(e.value)
    assert not [r for r in caplog.records if "memlock" in r.getMessage()]
    assert_explained(doctor("--device", "xla"), "--device xla cannot be used", "no xla backend")


def _xla_works() -> bool:
    try:
        torch.empty(0, device="xla")
    except Exception:
        return False
    return True


# --- a mistyped setting is named as such; the machine is blamed only for what it lacks -----------------


@pytest.mark.parametrize(
    "setting, value, allowed",
    [
        ("STAGEBUF_TIER", "uvaa", TIERS),
        ("STAGEBUF_TIER", "UVA!", TIERS),
        ("STAGEBUF_CHECK", "yes", "0, 1"),
        ("STAGEBUF_VLLM", "maybe", "0, 1, step"),
        ("STAGEBUF_WRITE_KERNEL", "cuda", "auto, scatter, triton"),
        ("STAGEBUF_CHECK_QUARANTINE", "many", "an int in [0, 1024]"),
        ("--device", "banana", "(omit --device), cpu"),
    ],
)
def test_a_mistyped_setting_is_an_invalid_value_not_the_machines_fault(setting, value, allowed):
    args, env = (["--device", value], {}) if setting == "--device" else ([], {setting: value})
    r = doctor(*args, env=env)
    assert_explained(r, f"allowed      {allowed}")
    asked = f"{setting} {value}" if setting == "--device" else f"{setting}={value}"
    headline = r.stdout.splitlines()[0]
    assert headline == (
        f"stagebuf doctor: {asked} cannot work anywhere: {value!r} is not a valid value of {setting}; "
        f"allowed: {allowed}"
    ), headline
    assert "this machine" not in r.stdout
    j = doctor_json(*args, env=env)
    assert j["kind"] == "invalid_value" and j["setting"] == setting and j["value"] == value


@pytest.mark.parametrize(("cuda", "cause", "fix"), BUILDS)
def test_a_valid_setting_this_machine_cannot_serve_blames_the_machine(monkeypatch, cuda, cause, fix):
    no_accelerator(monkeypatch, cuda)
    r = doctor(env={"STAGEBUF_TIER": "uva"})
    assert_explained(r, cause)
    assert r.stdout.splitlines()[0] == "stagebuf doctor: STAGEBUF_TIER=uva cannot work on this machine"
    assert "not a valid value" not in r.stdout
    assert doctor_json(env={"STAGEBUF_TIER": "uva"})["kind"] == "unavailable"


# --- nano-vllm: installed is not enough, it must import ----------------------------------------------

NANO_FAILS = {
    "flash_attn": (
        "raise ModuleNotFoundError(\"No module named 'flash_attn'\", name='flash_attn')\n",
        "ModuleNotFoundError: No module named 'flash_attn'",
        "pip install flash-attn",
    ),
    "runtime": (
        "raise RuntimeError('CUDA driver version is insufficient for CUDA runtime version')\n",
        "RuntimeError: CUDA driver version is insufficient for CUDA runtime version",
        "python -c 'import nanovllm'",
    ),
    "syntax": ("def broken(:\n", "SyntaxError: ", "python -c 'import nanovllm'"),
}


@pytest.fixture
def fake_nanovllm(tmp_path, monkeypatch):
    """A function that 'installs' nano-vllm-fork 20260210 in ``tmp_path`` (its metadata, and a package
    ``nanovllm`` whose ``__init__`` is the source given); any ``nanovllm`` imported before is hidden and
    put back afterwards."""
    hidden = {m: sys.modules.pop(m) for m in list(sys.modules) if m.split(".")[0] == "nanovllm"}

    def install(init: str) -> Path:
        d = tmp_path / "nano_vllm_fork-20260210.dist-info"
        d.mkdir()
        (d / "METADATA").write_text("Metadata-Version: 2.1\nName: nano-vllm-fork\nVersion: 20260210\n")
        (d / "top_level.txt").write_text("nanovllm\n")
        (tmp_path / "nanovllm").mkdir()
        (tmp_path / "nanovllm" / "__init__.py").write_text(init)
        monkeypatch.syspath_prepend(str(tmp_path))
        return tmp_path

    yield install
    for m in [m for m in sys.modules if m.split(".")[0] == "nanovllm"]:
        del sys.modules[m]
    sys.modules.update(hidden)


@pytest.mark.parametrize("case", list(NANO_FAILS))
def test_doctor_says_why_an_installed_nanovllm_cannot_be_imported(fake_nanovllm, case):
    init, error, fix = NANO_FAILS[case]
    fake_nanovllm(init)
    r = doctor(plain=True)
    assert r.exit_code == 0 and r.exception is None, r.output
    rows = {ln.strip().split("  ")[0]: ln for ln in r.stdout.splitlines() if ln.startswith("  nano-vllm")}
    assert "nano-vllm" in rows and "nano-vllm fix" in rows, r.stdout
    assert "nano-vllm-fork 20260210" in rows["nano-vllm"] and "cannot be imported" in rows["nano-vllm"]
    assert error in rows["nano-vllm"] and fix in rows["nano-vllm fix"], rows
    assert "puts its input preparation on stagebuf" not in r.stdout
    flat = " ".join(doctor().stdout.translate(str.maketrans("", "", "│┃")).split())  # rich wraps cells
    assert "cannot be imported" in flat and error.split(": ")[0] in flat
    j = json.loads(doctor("--json").stdout)["nanovllm"]
    assert j["installed"] is True and j["importable"] is False and j["import_error"].startswith(error)
    assert fix in j["fix"] and "cannot be imported" in j["note"]


def test_doctor_says_an_installed_nanovllm_that_imports_is_tested(fake_nanovllm):
    fake_nanovllm("LLM = object\n")
    r = doctor(plain=True)
    assert r.exit_code == 0, r.output
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("  nano-vllm")]
    assert "nano-vllm-fork 20260210, tested: stagebuf.nanovllm.attach(llm)" in line, line
    assert "cannot be imported" not in r.stdout
    j = json.loads(doctor("--json").stdout)["nanovllm"]
    assert j["installed"] is True and j["tested"] is True and "import_error" not in j


def test_a_real_process_names_nanovllms_missing_module(fake_nanovllm):
    root = fake_nanovllm(NANO_FAILS["flash_attn"][0])
    env = {"PYTHONPATH": os.pathsep.join([str(root), SRC, os.environ.get("PYTHONPATH", "")])}
    for args in (["-m", "stagebuf", "doctor"], ["-m", "stagebuf", "doctor", "--json"]):
        p = _run(args, env)
        assert p.returncode == 0 and "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
        flat = " ".join(p.stdout.translate(str.maketrans("", "", "│┃")).split())
        assert "No module named 'flash_attn'" in flat and "pip install flash-attn" in flat, flat


# --- every binding the vLLM plugin replaces, readable at 100 columns --------------------------------


@pytest.fixture
def vllm_files(monkeypatch):
    """vLLM's newest tested release importable as ``vllm`` (``benchmarks.vllm_mrv2.as_installed``, CPU): only
    its ``buffer_utils`` imported, as in a doctor process; the modules that bind its names are not."""
    from benchmarks import vllm_mrv2

    why = vllm_mrv2.available()
    if why:
        pytest.skip(f"needs vLLM {vllm_mrv2.NEWEST}'s files: {why}")
    if "vllm" in sys.modules:
        pytest.skip("a real vLLM is imported in this process")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    with vllm_mrv2.as_installed(torch.device("cpu")) as inst:
        yield inst


def _rich_report(width: int = 100) -> str:
    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None, force_terminal=False)
    doctor_mod.render(capabilities(), console)
    return out.getvalue()


def _listed(text: str) -> dict[str, list[str]]:
    """The bindings doctor lists below its table: ``module: name, name, ...`` lines, a long one continued
    on deeper-indented lines."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("vLLM plugin bindings"))
    groups: dict[str, list[str]] = {}
    module = None
    for ln in lines[start + 1 :]:
        if ln.startswith("    ") and module is not None:
            groups[module] += [n for n in ln.strip().split(", ") if n]
        elif ln.startswith("  ") and ": " in ln:
            module, _, names = ln.strip().partition(": ")
            groups[module] = [n for n in names.split(", ") if n]
        else:
            module = None
            if not ln.startswith("  "):
                break
    return {m: [n.rstrip(",") for n in ns] for m, ns in groups.items()}


@pytest.mark.parametrize("mode", ["1", "step"])
def test_doctor_lists_every_binding_the_vllm_plugin_replaces(vllm_files, monkeypatch, mode):
    """Doctor's list, made before vLLM imported the modules that bind buffer_utils' names, holds every
    binding of the plugin's own plan once they are imported, grouped by module, each name whole on a line
    of at most 100 columns."""
    from stagebuf._engines import vllm as _vllm

    monkeypatch.setenv("STAGEBUF_VLLM", mode)
    report = _rich_report()
    wide = [ln for ln in report.splitlines() if len(ln) > 100]
    assert not wide, wide
    listed = _listed(report)
    plain = _listed(doctor_mod.render_text(capabilities()))
    assert plain == listed
    for name in ("block_table", "states", "sample.states"):
        vllm_files.load(name)
    plan = _vllm.plan()
    assert plan.action == "patch" and plan.mode == mode
    want: dict[str, set[str]] = {}
    for obj, attr, _old, _new in plan.replacements:
        mod, attr = (
            (obj.__module__, f"{obj.__qualname__}.{attr}") if isinstance(obj, type) else (obj.__name__, attr)
        )
        want.setdefault(mod, set()).add(attr)
    assert len(want) >= 4 and sum(map(len, want.values())) >= 13 + 2 * (mode == "step"), want
    for mod, attrs in want.items():
        assert mod in listed and attrs <= set(listed[mod]), (mod, attrs, listed)
    assert all(re.search(rf"^  {re.escape(mod)}: ", report, re.M) for mod in listed)
    flat = " ".join(report.translate(str.maketrans("", "", "│┃")).split())
    count = sum(map(len, listed.values()))
    assert f"vLLM plugin patches {count} bindings in {len(listed)} modules" in flat, flat
    j = json.loads(doctor("--json", env={"STAGEBUF_VLLM": mode}).stdout)["vllm"]
    assert all(attrs <= set(j["bindings"].get(mod, ())) for mod, attrs in want.items()), j["bindings"]


@pytest.mark.parametrize("mode", ["1", "step"])
def test_without_vllm_doctor_lists_what_the_plugin_knows_and_says_what_it_cannot(monkeypatch, mode):
    from stagebuf._engines import vllm as _vllm
    from stagebuf._engines.vllm_check import REPLACED

    if _vllm.vllm_version() is not None or "vllm" in sys.modules:
        pytest.skip("vLLM is installed here")
    monkeypatch.setenv("STAGEBUF_VLLM", mode)
    report = _rich_report()
    assert not [ln for ln in report.splitlines() if len(ln) > 100]
    assert _listed(report) == {_vllm.TARGET: list(REPLACED)}
    flat = " ".join(report.translate(str.maketrans("", "", "│┃")).split())
    assert "known only with vLLM installed" in flat, flat
    assert (f"{_vllm.STEP_TARGET}" in flat) == (mode == "step")
    j = json.loads(doctor("--json", env={"STAGEBUF_VLLM": mode}).stdout)["vllm"]
    assert j["bindings"] == {_vllm.TARGET: list(REPLACED)}
    assert any("known only with vLLM installed" in n for n in j["bindings_notes"])


def test_doctor_reads_the_bindings_vllms_source_makes(tmp_path):
    """Only module-level ``from <buffer_utils> import`` of the plugin's names count: not one inside a
    function, under TYPE_CHECKING, or of another name; ``as`` names the binding."""
    pkg = tmp_path / "vllm"
    (pkg / "v1" / "worker" / "gpu").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    files = {
        "v1/worker/gpu/a.py": (
            "from vllm.v1.worker.gpu.buffer_utils import UvaBuffer, StagedWriteTensor as SWT\n"
        ),
        "v1/worker/gpu/b.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from vllm.v1.worker.gpu.buffer_utils import UvaBuffer\n"
            "def f():\n    from vllm.v1.worker.gpu.buffer_utils import UvaBufferPool\n"
            "from vllm.v1.worker.gpu.buffer_utils import async_copy_to_gpu\n"
        ),
        "v1/worker/gpu/c.py": (
            "try:\n    from .buffer_utils import UvaBackedTensor\nexcept ImportError:\n    pass\n"
        ),
        "v1/worker/gpu/d.py": "def broken(:\n",
    }
    for rel, src in files.items():
        (pkg / rel).write_text(src)
    got = doctor_mod.source_bindings(pkg)
    assert got == {
        "vllm.v1.worker.gpu.a": ["UvaBuffer", "SWT"],
        "vllm.v1.worker.gpu.c": ["UvaBackedTensor"],
    }
