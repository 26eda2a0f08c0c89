"""Small things of issue 51 from Python: an address without its port says so, a layer runner
given no such script says so, and
``python -m ferry doctor | head`` ends quietly."""

import subprocess
import sys

import pytest

import ferry


def test_connect_to_an_address_without_a_port_says_the_port_is_missing():
    e = ferry.Engine()
    with pytest.raises(ferry.FerryError) as info:
        e.connect("127.0.0.1")
    said = str(info.value)
    assert "port" in said and "invalid socket address" not in said, said


def test_doctor_into_a_closed_pipe_ends_without_a_traceback():
    # `head -1` reads one line and closes the pipe.
    p = subprocess.run(f"{sys.executable} -m ferry doctor | head -1", shell=True,
                       capture_output=True, text=True, timeout=120)
    assert p.stdout.strip() == "{", p.stdout
    assert "Traceback" not in p.stderr and "BrokenPipeError" not in p.stderr, p.stderr


@pytest.mark.parametrize("layer", ["mooncake", "nixl"])
def test_a_layer_runner_given_no_such_script_says_so_without_a_traceback(tmp_path, layer):
    p = subprocess.run([sys.executable, "-m", f"ferry.{layer}", str(tmp_path / "nosuch.py")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert f"python -m ferry.{layer}: no such script" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
