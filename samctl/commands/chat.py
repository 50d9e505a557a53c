"""`samctl chat`: an interactive console on the model's chat template, streaming, multi-turn.

Each turn the whole conversation, rendered by the tokenizer's chat template, is the prompt; the
answer streams as it is accepted, then one line reports the turn: new tokens, tokens/s and
accepted tokens per step (and with /compare, plain decoding's tokens/s on the same prompt, the
speedup and whether the outputs are identical). A drafter is kept per method for the whole
session, so adaptive's memory of earlier answers and Token Recycle's table carry over from turn
to turn (and across /method switches). Lines starting with "/" are commands (/help lists them);
Ctrl-D or /quit ends the session, Ctrl-C stops the answer being generated.
"""
from __future__ import annotations

import sys
from typing import Any

import click

from samctl.decode.methods import DEFAULT_METHOD, METHODS
from samctl.options import sampling_options, weight_options

HELP = """commands:
  /method NAME   draft with another method ({methods}); each keeps its own memory
  /compare       toggle running plain decoding (ar) on each prompt too, side by side
  /sources       show where the drafts come from and how often each source is accepted
  /reset         start a new conversation (the drafters keep what they learned)
  /help          this list
  /quit          leave (or Ctrl-D)"""


@click.command("chat")
@click.option("--model", "model_path", metavar="PATH", help="Local model folder or .gguf file (default: the embedded model).")
@click.option("--sam", "store_path", metavar="STORE", type=click.Path(exists=True, dir_okay=False),
              help="Static datastore built with the model's tokenizer.")
@click.option("--method", type=click.Choice(METHODS), default=DEFAULT_METHOD, show_default=True, help="Drafting method to start with.")
@click.option("--system", metavar="TEXT", help="A system message at the start of the conversation.")
@click.option("--max-new-tokens", type=int, default=512, show_default=True, help="Longest answer per turn.")
@click.option("--compare", is_flag=True, help="Start with the side-by-side ar comparison on (/compare toggles it).")
@sampling_options
@click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto", show_default=True, help="As for generate.")
@weight_options
@click.option("--threads", type=int, default=None, help="torch CPU threads; 1 is steadier on a busy machine.")
@click.option("--quiet", is_flag=True, help="No loading notes on stderr.")
def chat(**opts: Any) -> None:
    """Talk to the model, faster, with per-turn speed and acceptance.

    \b
    samctl chat
    samctl chat --model ./SmolLM2-135M-Instruct --sam store.sam --compare
    """
    from samctl.decode.loop import GenerationConfig
    from samctl.decode.sampling import SamplingConfig
    from samctl.options import method_config, set_threads
    from samctl.runtime import load_engine, load_store

    set_threads(opts["threads"])
    sampling = SamplingConfig(opts["temperature"], opts["top_k"], opts["top_p"], opts["seed"])
    engine = load_engine(opts["model_path"], opts["device"], opts["dtype"], quiet=opts["quiet"],
                         quantize=opts["quantize"], prepack=opts["prepack"])
    gen_config = GenerationConfig(max_new_tokens=opts["max_new_tokens"], eos_token_ids=engine.eos_token_ids,
                                  sampling=sampling)
    store = load_store(opts["store_path"], engine)
    console = Console(engine, store, method_config({}, engine.device), gen_config, opts)
    console.loop()


class Console:
    """The conversation, the drafters (one per method, kept) and the read-eval loop."""

    def __init__(self, engine, store, config, gen_config, opts: dict[str, Any]) -> None:
        self.engine, self.store, self.config, self.gen_config = engine, store, config, gen_config
        self.method = opts["method"]
        self.compare = opts["compare"]
        self.system = opts["system"]
        self.store_name = opts["store_path"]
        self.chat_template = bool(getattr(engine.tokenizer, "chat_template", None))
        self.runners: dict[str, Any] = {}
        self.messages: list[dict[str, str]] = []
        self.reset()

    def loop(self) -> None:
        template = "the chat template" if self.chat_template else "no chat template (turns joined by blank lines)"
        click.echo(f"samctl chat: {self.engine.name}, method {self.method}, {template}; /help for commands")
        while True:
            try:
                line = input("you> ")
            except EOFError:
                click.echo()
                return
            except KeyboardInterrupt:
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
        from samctl.decode.methods import method as method_entry

        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name in ("/quit", "/exit"):
            return False
        if name == "/help":
            click.echo(HELP.format(methods=", ".join(METHODS)))
        elif name == "/method":
            if arg not in METHODS:
                click.echo(f"unknown method {arg!r}: choose one of {', '.join(METHODS)}")
            else:
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
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def turn(self, text: str) -> None:
        from samctl.commands.generate import _Streamer

        self.messages.append({"role": "user", "content": text})
        ids = self.engine.encode_conversation(self.messages, chat=self.chat_template)
        runner = self._runner()
        stream = _Streamer(self.engine)
        try:
            result = runner._run(runner.drafter, ids, stream)
        except KeyboardInterrupt:
            sys.stdout.write("\n[stopped]\n")
            self.messages.pop()
            return
        stream.finish()
        m = result.metrics
        line = (f"[{self.method}: {m.new_tokens} tokens, {m.tokens_per_s:.1f} tok/s, "
                f"{m.mean_accepted:.2f} tokens/step")
        if self.compare:
            c = runner._compare(ids, result)
            same = {True: "identical", False: f"DIFFER at token {c['first_difference']}", None: "sampled"}[c["identical"]]
            line += f" | ar: {c['ar_tokens_per_s']:.1f} tok/s, speedup {c['speedup']:.2f}x, {same}"
        click.echo(line + "]")
        self.messages.append({"role": "assistant", "content": self.engine.decode(result.tokens)})

    def sources(self) -> str:
        from samctl.decode.methods import method as method_entry

        entry = method_entry(self.method)
        store = self.store_name if self.store is not None and entry.uses_store else "none"
        lines = [f"method {self.method}: {entry.summary}", f"store: {store}"]
        drafter = self.runners[self.method].drafter if self.method in self.runners else None
        report = getattr(drafter, "report", None)
        if report is not None:
            info = report()
            lines.append(f"memory: {info['memory_requests']} earlier answer(s) this session")
            for source, cell in info["calibration"].items():
                lines.append(f"  {source:<8} {cell['trials']:>8.0f} drafted, {100 * cell['rate']:.1f}% accepted")
        elif drafter is None:
            lines.append("(no turn with this method yet)")
        return "\n".join(lines)

    def _runner(self):
        from samctl.decode.methods import uses_store
        from samctl.commands.generate import Runner
        from samctl.runtime import build_drafter

        if self.method not in self.runners:
            name = self.method
            store = self.store if uses_store(name) else None

            def fresh():
                return build_drafter(name, self.engine, store, self.config, sampling=self.gen_config.sampling,
                                     quiet=True)

            self.runners[name] = Runner(self.engine, fresh(), fresh, self.gen_config, compare=True, compare_runs=1,
                                        chat=self.chat_template, record={"method": name})
        return self.runners[self.method]

