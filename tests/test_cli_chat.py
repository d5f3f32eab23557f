"""`tandem chat` in a real pseudo-terminal: line editing and history, a pasted line longer
than the terminal's 4,095-character line limit, Ctrl-C that stops an answer and returns to
the prompt, a second Ctrl-C or Ctrl-D that leaves.

The model is a stand-in (it answers with the length of what it received, or streams without
end for "loop"), so the test checks the terminal handling, not generation."""

from __future__ import annotations

import os
import pty
import signal
import sys
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT_S = 30.0  # safety limit for every wait; each wait ends on the awaited output
# select, poll, pselect6, ppoll on x86-64, and pselect6, ppoll on arm64: where readline waits for a key
WAITING_SYSCALLS = {"23", "7", "270", "271"} if os.uname().machine == "x86_64" else {"72", "73"}

DRIVER = r"""
import sys, time
sys.path.insert(0, {root!r})
from runtime.llm import cli

class Metrics:
    time_to_first_token = 0.001
    decode_tokens_per_s = None

class Out:
    def __init__(self, text, finished, n):
        self.delta_text, self.finished, self.token_ids = text, finished, [0] * n
        self.finish_reason = "length" if finished else None
        self.metrics = Metrics()

class StandIn:
    tokenizer = None

    def apply_chat_template(self, history):
        return history[-1]["content"]

    def stream(self, prompt, params):
        if prompt == "loop":
            try:
                n = 0
                while True:  # an answer that never ends by itself, one token per "step"
                    n += 1
                    yield Out("tok ", False, n)
                    time.sleep(0.01)
            finally:
                print("[request aborted]", flush=True)
        yield Out(f"got {{len(prompt)}} chars", True, 1)

cli.load_llm = lambda args: (StandIn(), None)
from tandem.cli import main
sys.exit(main(["chat"]))
"""


class Terminal:
    """A child process on a pseudo-terminal, with everything it prints collected by a thread."""

    def __init__(self, tmp_path) -> None:
        script = tmp_path / "driver.py"
        script.write_text(DRIVER.format(root=ROOT))
        env = dict(os.environ, HOME=str(tmp_path), TANDEM_CACHE_DIR=str(tmp_path / "cache"), TERM="xterm")
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal, so ^C becomes SIGINT
            # An ignored SIGINT survives exec, and Python then leaves it ignored: start as a
            # shell would start a foreground job, whatever the test process did with it.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execve(sys.executable, [sys.executable, str(script)], env)
        self.output = ""
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.fd, 65536)
            except OSError:
                data = b""
            with self._cond:
                if not data:
                    self.closed = True
                    self._cond.notify_all()
                    return
                self.output += data.decode(errors="replace")
                self._cond.notify_all()

    closed = False

    def expect(self, text: str, start: int) -> int:
        """Wait until `text` appears after position `start`; the position after it."""
        with self._cond:
            ok = self._cond.wait_for(lambda: text in self.output[start:] or self.closed, LIMIT_S)
            at = self.output.find(text, start)
            assert ok and at >= 0, f"{text!r} never came; output after {start}: {self.output[start:][-500:]!r}"
            return at + len(text)

    def send(self, data: str) -> None:
        os.write(self.fd, data.encode())

    def blocked_in_select(self) -> bool:
        """Whether the child's main thread is waiting in select/poll (the kernel's own record,
        /proc/PID/syscall: the number of the system call a blocked thread is in)."""
        try:
            with open(f"/proc/{self.pid}/syscall") as f:
                number = f.read().split(" ", 1)[0]
        except OSError:
            return False
        return number in WAITING_SYSCALLS

    def interrupt_at_prompt(self, start: int, handled) -> None:
        """Type a character, wait for readline to echo it and go back to waiting for the next
        key, then send ^C and wait until `handled()`. CPython's readline loop looks at signals
        only when its select() is interrupted: a ^C that lands between readline's echo of a key
        and its next select() stays pending until the line ends (a real user is never that
        quick; a busy machine makes the test that quick). So ^C goes only once the kernel says
        the child sits in select()."""
        self.send("z")
        self.expect("z", start)
        deadline = time.monotonic() + LIMIT_S
        with self._cond:
            while not self.blocked_in_select():
                assert time.monotonic() < deadline, f"chat never waited for a key; output: {self.output[-500:]!r}"
                self._cond.wait(0.01)  # a state the kernel holds, not an event we can wait on
        self.send("\x03")
        with self._cond:
            ok = self._cond.wait_for(lambda: handled() or self.closed, LIMIT_S)
        assert ok, f"^C had no effect; output: {self.output[-500:]!r}"

    def wait_exit(self) -> int:
        deadline = time.monotonic() + LIMIT_S
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            with self._cond:
                self._cond.wait_for(lambda: self.closed, 0.1)
        os.kill(self.pid, 9)
        raise AssertionError(f"chat did not exit; output: {self.output[-500:]!r}")


@pytest.fixture()
def term(tmp_path):
    t = Terminal(tmp_path)
    yield t
    try:
        os.kill(t.pid, 9)
        os.waitpid(t.pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def test_ctrl_c_stops_the_answer_and_a_second_one_leaves(term):
    pos = term.expect("> ", 0)
    term.send("loop\r")
    pos = term.expect("tok tok ", pos)
    term.send("\x03")  # stops the answer, not the program
    pos = term.expect("[request aborted]", pos)
    pos = term.expect("> ", pos)
    term.send("hi\r")  # the chat goes on
    pos = term.expect("got 2 chars", pos)
    pos = term.expect("> ", pos)
    hint = "Ctrl-C again or Ctrl-D to leave"
    term.interrupt_at_prompt(pos, lambda: hint in term.output[pos:])
    pos = term.expect(hint, pos)
    pos = term.expect("> ", pos)
    term.interrupt_at_prompt(pos, lambda: False)  # until the program ends (the terminal closes)
    assert term.wait_exit() == 0
    assert "Traceback" not in term.output


def test_ctrl_d_leaves(term):
    pos = term.expect("> ", 0)
    term.send("z\x7f")  # type and erase: readline is reading keys now
    term.expect("z", pos)
    term.send("\x04")
    assert term.wait_exit() == 0 and "Traceback" not in term.output


def test_a_long_pasted_line_arrives_whole(term):
    pos = term.expect("> ", 0)
    line = "x" * 10_000  # a canonical-mode terminal cuts a line at 4,095 characters
    for i in range(0, len(line), 1000):
        term.send(line[i : i + 1000])
    term.send("\r")
    term.expect("got 10000 chars", pos)


def test_arrow_keys_edit_the_line_and_recall_history(term):
    pos = term.expect("> ", 0)
    term.send("abc\x1b[D\x1b[DX\r")  # left, left, insert X: "aXbc", not escape codes
    pos = term.expect("got 4 chars", pos)
    pos = term.expect("> ", pos)
    term.send("\x1b[A\x1b[A\r")  # up: the previous line again ("aXbc" was the only one)
    term.expect("got 4 chars", pos)
