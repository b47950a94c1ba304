"""docs/cli.md quotes every command's --help: each quote is what the command prints now."""

from __future__ import annotations

import os
import re

from click.testing import CliRunner

from ktc.cli import main

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "cli.md")


def test_the_docs_quote_each_command_s_help_as_it_reads_now():
    """Each "## ktc COMMAND" section's quoted help has the words ``ktc COMMAND --help`` prints
    (five of ten had drifted: options added since were missing from them; regenerate them with
    ``ktc COMMAND --help`` where stdout is not a terminal, 78 columns)."""
    with open(DOCS) as f:
        text = f.read()
    quoted = re.findall(r"^## ktc (\S+)\n\n```\n(.*?)```", text, re.S | re.M)
    assert len(quoted) >= 10
    for command, block in quoted:
        result = CliRunner().invoke(main, [command, "--help"], prog_name="ktc", terminal_width=78)
        assert result.exit_code == 0, result.output
        # the words, not the layout: another click may wrap the same text otherwise
        assert result.output.split() == block.split(), f"docs/cli.md's ktc {command} --help differs from the command's"
