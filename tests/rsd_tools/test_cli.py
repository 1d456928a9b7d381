"""`rsd generate` in process on the tiny pair: the verification flag reaches the generator and is reported; a
target numeric mode it cannot take is refused."""

from __future__ import annotations

import pytest

from rsd_tools import cli


def test_generate_in_process_with_a_verification(tmp_path, capsys):
    argv = ["generate", "--tiny", "--cache-dir", str(tmp_path), "--prompt", "w7 w8", "--max-new-tokens", "6"]
    argv += ["--method", "rsd_c", "--shape", "2,1", "--temperature", "1", "--verification", "traversal"]
    assert cli.main(argv) == 0
    assert "rule=traversal]" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="block verification is exact for one chain only"):
        cli.main([*argv[:-1], "block"])  # refused before any model loads
    with pytest.raises(SystemExit, match="not a GGUF file"):  # the tiny pair is a checkpoint folder
        cli.main([*argv, "--target-numeric", "q8_activations"])
