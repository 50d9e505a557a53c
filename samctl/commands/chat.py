"""`samctl chat`: an interactive console on the model's chat template, streaming, multi-turn.

Each turn's prompt is the whole conversation; the answer streams as it is accepted, then one line
reports the turn. A session (with its drafter) is kept per method, so adaptive's memory and Token
Recycle's table carry over from turn to turn and across /method switches.
"""
from __future__ import annotations

import sys
from typing import Any

import click

from samctl.config import SessionConfig
from samctl.decode.methods import ALL_METHODS, method as method_entry
from samctl.index.errors import UserError
from samctl.options import cli_message, session_options
from samctl.plan import plan

HELP = """commands:
  /method NAME   draft with another method ({methods}); each keeps its own memory
  /compare       toggle running plain decoding (ar) on each prompt too, side by side
  /sources       show where the drafts come from and how often each source is accepted
  /reset         start a new conversation (the drafters keep what they learned)
  /help          this list
  /quit          leave (or Ctrl-D)"""


@click.command("chat")
@session_options(exclude=("chat", "memory_file"), method={"help": "Drafting method to start with."},
                 store={"type": click.Path(exists=True), "help": "Static datastore built with the model's tokenizer: a "
                        ".sam file or a store directory (sharded, or a suffix array)."},
                 max_new_tokens={"default": 512, "help": "Longest answer per turn."})
@click.option("--system", metavar="TEXT", help="A system message at the start of the conversation.")
@click.option("--compare", is_flag=True, help="Start with the side-by-side ar comparison on (/compare toggles it).")
def chat(config: SessionConfig, system: str | None, compare: bool) -> None:
    """Talk to the model, faster, with per-turn speed and acceptance.

    \b
    samctl chat
    samctl chat --model ./SmolLM2-135M-Instruct --sam store.sam --compare
    """
    plan(config)  # a missing draft model or head is refused now, not after torch loads (seconds)
    from samctl.session import Session

    Console(Session(config), system, compare).loop()


class Console:
    """The conversation, the sessions (one per method, on one engine, each keeping its drafter)
    and the read-eval loop."""

    def __init__(self, session, system: str | None, compare: bool) -> None:
        self.engine = session.engine
        self.sessions = {session.config.method: session}
        self.method = session.config.method
        self.compare, self.system = compare, system
        self.store_name = session.config.store
        self.chat_template = bool(getattr(self.engine.tokenizer, "chat_template", None))
        self.reset()

    def loop(self) -> None:
        template = "the chat template" if self.chat_template else "no chat template (turns joined by blank lines)"
        click.echo(f"samctl chat: {self.engine.name}, method {self.method}, {template}; /help for commands")
        while True:
            try:
                line = input("you> ")
            except (EOFError, KeyboardInterrupt):
                click.echo()
                return
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                if not self.command(line):
                    return
                continue
            self.turn(line)

    def command(self, line: str) -> bool:
        """Run one /command; False to leave."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name in ("/quit", "/exit"):
            return False
        if name == "/help":
            click.echo(HELP.format(methods=", ".join(ALL_METHODS)))
        elif name == "/method":
            if arg not in ALL_METHODS:
                click.echo(f"unknown method {arg!r}: choose one of {', '.join(ALL_METHODS)}")
            else:
                try:  # what the method needs (a draft model, a head, a SAT model) was given at start, or never
                    self._session(arg)
                except UserError as err:
                    click.echo(f"samctl: {cli_message(err)}: restart samctl chat with it "
                               f"(the method stays {self.method})")
                    return True
                self.method = arg
                click.echo(f"method: {arg} ({method_entry(arg).summary})")
        elif name == "/compare":
            self.compare = not self.compare
            click.echo(f"side-by-side ar comparison: {'on' if self.compare else 'off'}")
        elif name == "/sources":
            click.echo(self.sources())
        elif name == "/reset":
            self.reset()
            click.echo("new conversation")
        else:
            click.echo(f"unknown command {name}: /help lists them")
        return True

    def reset(self) -> None:
        self.messages: list[dict[str, str]] = [{"role": "system", "content": self.system}] if self.system else []

    def turn(self, text: str) -> None:
        from samctl.detok import TextStream

        self.messages.append({"role": "user", "content": text})
        ids = self.engine.encode_conversation(self.messages, chat=self.chat_template)
        session = self._session(self.method)
        stream = TextStream(session.decode)
        try:
            result = session.generate(ids, on_tokens=stream.push)
        except KeyboardInterrupt:
            sys.stdout.write("\n[stopped]\n")
            self.messages.pop()
            return
        stream.finish()
        m = result.metrics
        line = (f"[{self.method}: {m.new_tokens} tokens, {m.tokens_per_s:.1f} tok/s, "
                f"{m.mean_accepted:.2f} tokens/step")
        if self.compare:
            c = session.compare(ids, result)
            same = {True: "identical", False: f"DIFFER at token {c['first_difference']}", None: "sampled"}[c["identical"]]
            line += f" | ar: {c['ar_tokens_per_s']:.1f} tok/s, speedup {c['speedup']:.2f}x, {same}"
        click.echo(line + "]")
        self.messages.append({"role": "assistant", "content": self.engine.decode(result.tokens)})

    def sources(self) -> str:
        entry = method_entry(self.method)
        store = self.store_name if self.store_name and entry.uses_store else "none"
        lines = [f"method {self.method}: {entry.summary}", f"store: {store}"]
        return "\n".join(lines + _report_lines(self.sessions[self.method].drafter.report()))

    def _session(self, method: str):
        """The kept session of `method`, on the same engine as the others (built on first use)."""
        if method not in self.sessions:
            first = next(iter(self.sessions.values()))
            self.sessions[method] = first.for_method(method)
        return self.sessions[method]


def _report_lines(info: dict[str, Any]) -> list[str]:
    """A drafter's `report()` as lines: adaptive's memory and calibration per source, and any
    other drafter's figures (lookahead's pool) as name: value."""
    lines = []
    if "memory_requests" in info:
        lines.append(f"memory: {info['memory_requests']} earlier answer(s) this session")
    for source, cell in info.get("calibration", {}).items():
        lines.append(f"  {source:<8} {cell['trials']:>8.0f} drafted, {100 * cell['rate']:.1f}% accepted")
    lines += [f"{key.replace('_', ' ')}: {value}" for key, value in info.items()
              if key not in ("memory_requests", "calibration")]
    return lines
