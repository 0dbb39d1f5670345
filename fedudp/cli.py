"""The ``fedudp`` command: argv -> Hydra -> ``fedudp.run.run`` (docs/architecture.md#configuration-and-outputs).

``fedudp method=joint_dp privacy.epsilon=1 -m partition.num_owners=4,16,64``. One call is
one run; each run writes to its Hydra output folder (``fedudp.run``).

This module imports only the standard library when it is loaded: ``fedudp --version`` and
``fedudp --help`` never import Hydra; the runner (``fedudp.run``: torch, the accountant) is
imported when a job starts (tests/test_startup.py, scripts/benchmarks/bench_startup.py).
Composing the config (``--cfg job``, each run's preflight) imports torch and dp_accounting too:
the schema's ``estimator.*`` defaults come from the estimator registry (its modules).

Config files (``+experiment=<name>``, ``tracking=<name>``) are looked up on Hydra's search path:
first fedudp's own tree (``CONF_DIR``: the package's ``conf/``, which in a checkout is the
top-level ``conf/``), then ``./conf`` of the current directory, where your own experiment files
go (``./conf/experiment/mine.yaml`` -> ``fedudp +experiment=mine``). A file there with the
name of one of fedudp's own but other content is refused (rename it), so the order never picks
one silently.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path
from typing import cast

__all__ = ["main", "CONF_DIR", "USER_CONF", "preflight", "canary_text", "user_searchpath"]

# The config tree ships inside the package (package data, pyproject.toml; in the checkout
# fedudp/conf is a link to the top-level conf/): the same path in an editable install, a wheel,
# a Flower FAB and a Ray/joblib launcher worker.
CONF_DIR = str(Path(__file__).resolve().parent / "conf")
# the current directory's own config files (a user's experiments), after fedudp's on the path
USER_CONF = "conf"


def _hydra_main() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import DictConfig, OmegaConf

    from fedudp.config import ConfigError, RunConfig, check_known_keys, register

    register()

    @hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
    def _main(dcfg: DictConfig) -> float | None:
        # the runner (torch, the accountant): imported once a job starts, not for --help / --cfg
        from fedudp import run as runner
        from fedudp import tracking
        from fedudp.privacy.labels import epsilon_display, epsilon_kind

        try:
            check_known_keys(dcfg)  # to_object would drop a '+key' silently
        except ConfigError as e:
            fail(str(e))
        cfg = cast(RunConfig, OmegaConf.to_object(dcfg))  # the structured schema's dataclass
        hc = HydraConfig.get()
        out_dir = hc.runtime.output_dir
        sweep = None
        if hc.mode == RunMode.MULTIRUN:
            sweep = tracking.Sweep(
                folder=str(Path(hc.sweep.dir).absolute()),
                job=Path(out_dir).name,
                overrides=tuple(hc.overrides.task),
                command=" ".join(["fedudp", *sys.argv[1:]]),
            )
        try:
            # a resumed run (resume=<folder>) runs in that folder, tracked on its own
            summary, _, _, folder = runner.run_with_result(cfg, out_dir, sweep=sweep)
            out_dir = str(folder)
        except ConfigError as e:
            fail(str(e))
        acc = summary["accuracy_mean"]
        if summary.get("skipped"):
            print(f"[{summary['method']}] finished before in {out_dir}: skipped")
        stop = summary["stop_reason"]
        if stop in ("diverged", "interrupted", "failed"):
            print(
                f"fedudp: {stop}: {summary['stop_message']} (outputs in {out_dir})", file=sys.stderr
            )
            multirun = HydraConfig.get().mode == RunMode.MULTIRUN
            if stop == "interrupted":
                exit_now(128 + int(summary.get("signal", 2)))
            if not multirun:
                raise SystemExit(3)
        acc_s = "n/a" if acc is None else f"{acc:.4f} ± {summary['accuracy_std']:.4f}"
        eps = epsilon_display(summary["epsilon"], epsilon_kind(summary))
        print(
            f"[{summary['method']}] accuracy {acc_s}"
            f"  epsilon {eps}"
            f"  rounds {summary['rounds_completed']}  ({summary['seconds']:.1f}s)"
            + canary_text(summary.get("canary_epsilon_estimate"))
        )
        return acc

    _main()


def canary_text(est: dict | None) -> str:
    """The last line's canary part (``audit.canaries``): the one-run ε estimate, its interval
    and that it is an estimate, not a bound ('' without canaries).

    Parameters
    ----------
    est : dict or None
        summary.json's ``canary_epsilon_estimate`` (``value``, ``ci``, ``kind``, ``canaries``).

    Returns
    -------
    str
        The text, led by two spaces; '' for None or an empty dict.
    """
    if not est:
        return ""
    if est.get("value") is None:
        return f"  canary epsilon n/a ({est.get('note', 'no estimate')})"
    lo, hi = est["ci"]
    return (
        f"  canary epsilon {est['value']:.3f} [{lo:.3f}, {hi:.3f}] "
        f"({est['kind']}; {est['canaries']} canaries)"
    )


def exit_now(code: int) -> None:
    """End an interrupted run with ``code`` (every output is written by now) without the
    interpreter's teardown: after SIGTERM, Ray's C++ core worker aborts the process while it
    finalizes (exit status -6 instead of 143)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def multirun_flag_first(argv: list[str]) -> list[str]:
    """Hydra's parser rejects overrides on both sides of ``-m``; move the flag to the front so
    that ``fedudp method=joint_dp -m partition.num_owners=4,16,64`` works as documented."""
    flags = [a for a in argv if a in ("-m", "--multirun")]
    return flags[:1] + [a for a in argv if a not in ("-m", "--multirun")]


def fail(message: str) -> None:
    """The one way a user error ends a run: one line on stderr, exit status 2."""
    print(f"fedudp: error: {message.strip().splitlines()[0]}", file=sys.stderr)
    raise SystemExit(2)


def user_searchpath(argv: list[str], cwd: str | Path | None = None) -> list[str]:
    """``argv`` with ``./conf`` of the current directory on Hydra's search path (after fedudp's
    own config tree), where that folder exists and is not fedudp's own (a checkout's top-level
    ``conf/`` is). A ``hydra.searchpath=...`` given on the command line is left as it is (it
    replaces this one). A file there that shadows one of fedudp's with other content is refused:
    fedudp's comes first on the path, so the user's would be ignored silently.

    Parameters
    ----------
    argv : list of str
        The command line's arguments.
    cwd : str or Path or None
        The current directory (None: ``Path.cwd()``).

    Returns
    -------
    list of str
        ``argv``, with ``hydra.searchpath=[...]`` inserted before the first override.

    Raises
    ------
    SystemExit
        Status 2 (``fail``): a file in ``./conf`` shadows one of fedudp's with other content.
    """
    conf = Path(cwd or Path.cwd()) / USER_CONF
    if not conf.is_dir() or conf.resolve() == Path(CONF_DIR).resolve():
        return argv
    if any(a.lstrip("+~").startswith("hydra.searchpath=") for a in argv):
        return argv
    own = Path(CONF_DIR)
    for mine in sorted(conf.rglob("*.yaml")):
        rel = mine.relative_to(conf)
        theirs = own / rel
        if theirs.is_file() and theirs.read_bytes() != mine.read_bytes():
            fail(
                f"{mine}: fedudp's own conf/{rel.as_posix()} has that name and comes first on "
                f"the config search path; rename your file (e.g. {rel.stem}_mine.yaml)"
            )
    path = str(conf.resolve()).replace("\\", "\\\\").replace("'", "\\'")
    # beside the other overrides: Hydra's parser takes them as one run of positional arguments
    at = next((i for i, x in enumerate(argv) if "=" in x and not x.startswith("-")), len(argv))
    return [*argv[:at], f"hydra.searchpath=['file://{path}']", *argv[at:]]


def preflight(argv: list[str]) -> None:
    """Compose the config the way Hydra will (first value of each sweep) so that an unknown key
    or a bad value ends as ``fedudp: error: <key>: ...`` before Hydra starts any job.

    Parameters
    ----------
    argv : list of str
        The command line's arguments (``key=value`` overrides and flags).

    Raises
    ------
    SystemExit
        Status 2 (``fail``): an unparsable override, an unusable output folder, an unknown
        key, a bad value or a missing config group option.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigAttributeError, OmegaConfBaseException

    from fedudp.config import ConfigError, check_known_keys, register, unknown_key_message

    args = [a for a in argv if not a.startswith("-") and "=" in a]
    try:
        parsed = OverridesParser.create().parse_overrides(args)
    except HydraException as e:
        fail(str(e))
    first: list[str] = []
    for o in parsed:
        key = o.get_key_element().lstrip("+~")
        if key in ("hydra.run.dir", "hydra.sweep.dir"):
            check_output_path(key, o.get_value_element_as_str())
        if key == "hydra.searchpath":  # where +experiment=<name> is looked up
            assert o.input_line is not None  # parsed from a line
            first.append(o.input_line)
        if key.startswith("hydra"):
            continue
        value = (
            next(iter(o.sweep_string_iterator()), None)
            if o.is_sweep_override()
            else o.get_value_element_as_str()
        )
        first.append(f"{o.get_key_element()}={value}")
    register()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            composed = compose(config_name="config", overrides=first)
            check_known_keys(composed)  # a '+key' the schema lacks: not dropped silently
            OmegaConf.to_object(composed)
    except ConfigError as e:
        fail(str(e))
    except (HydraException, OmegaConfBaseException) as e:
        marker = "ConfigError raised while resolving interpolation: "
        if marker in str(e):  # raised by a resolver (huang_table3)
            fail(str(e).split(marker, 1)[1])
        cause = e.__cause__ if isinstance(e.__cause__, OmegaConfBaseException) else e
        full_key: str | None = getattr(cause, "full_key", None)
        if full_key and isinstance(cause, ConfigAttributeError):  # a key the schema lacks
            fail(unknown_key_message(full_key))
        text = str(cause).strip().splitlines()[0]
        if "MissingConfigException" in type(e).__name__:
            options = [ln.strip() for ln in str(e).split("Config search path")[0].splitlines()[3:]]
            text += f" (available: {', '.join(o for o in options if o)})"
        fail(f"{full_key}: {text}" if full_key else text)


def check_output_path(key: str, value: str) -> None:
    """An output folder the run could not create ends as one line naming ``key``, before any
    work: its nearest existing ancestor must be a writable folder (Hydra's own interpolations,
    ``${...}``, are left to Hydra: only the literal part before them is checked)."""
    literal = value.split("${", 1)[0]
    path = Path(literal or ".").expanduser().absolute()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        fail(f"{key}={value}: {probe} is a file, not a folder; choose another output folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        fail(f"{key}={value}: {probe} is not writable; choose another output folder")
    if literal == value:  # no interpolation: create it now, as Hydra would next
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            fail(f"{key}={value}: cannot create it ({e.strerror}); choose another output folder")


def resume_in_place(argv: list[str]) -> list[str]:
    """``resume=<folder>`` continues the run in that folder: Hydra's own run folder is the same
    (no new dated folder), unless ``hydra.run.dir`` is given."""
    folder = next((a.split("=", 1)[1] for a in argv if a.startswith("resume=")), None)
    if (
        not folder
        or folder in ("null", "None")
        or any(a.startswith("hydra.run.dir=") for a in argv)
    ):
        return argv
    return argv + [f"hydra.run.dir={folder}"]


HELP = """usage: fedudp [-m] [key=value ...] [+experiment=NAME] [--cfg job] [--version]

Federated-learning simulation with user-level and joint differential privacy. One call is one
run; with -m, comma-separated values sweep (one run each). Every key=value overrides the
configuration (keys and defaults: fedudp --cfg job; docs/usage.md).

  fedudp method=joint_dp privacy.epsilon=1 train.rounds=5
  fedudp -m method=per_silo,fedavg,full_dp,joint_dp partition.num_owners=4,16
  fedudp +experiment=huang_table1 dataset.root=/path/to/idx
  fedudp resume=outputs/<date>/<time>_joint_dp    continue a stopped run
  fedudp --cfg job [key=value ...]                print the resolved configuration
  fedudp --version                                the installed version
  fedudp --hydra-help                             Hydra's own flags (launchers, logging)

Config groups (group=option; +experiment=NAME adds a preset):
{groups}
Config files: fedudp's own ({own}), then ./conf of this folder (your own experiments,
./conf/experiment/NAME.yaml).
"""


def help_text(cwd: str | Path | None = None) -> str:
    """``fedudp --help``: usage, examples and the config groups' options (fedudp's and the
    current directory's ``./conf``), read from the folders without importing Hydra."""
    trees = [Path(CONF_DIR), Path(cwd or Path.cwd()) / USER_CONF]
    options: dict[str, set[str]] = {}
    for tree in trees:
        for group in sorted(p for p in tree.glob("*") if p.is_dir()) if tree.is_dir() else ():
            options.setdefault(group.name, set()).update(f.stem for f in group.glob("*.yaml"))
    groups = "".join(
        textwrap.fill(
            f"{g}: {', '.join(sorted(o))}", 96, initial_indent="  ", subsequent_indent="    "
        )
        + "\n"
        for g, o in sorted(options.items())
    )
    return HELP.format(groups=groups, own=Path(CONF_DIR).resolve())


def main() -> None:
    """The ``fedudp`` command: ``--version``, ``--help``, else a Hydra run (or sweep).

    Reads ``sys.argv``: resumes in place, adds ``./conf`` to the search path, checks the
    config (``preflight``) and hands over to Hydra.

    Raises
    ------
    SystemExit
        Status 2 for a user error (one line on stderr).
    """
    if sys.argv[1:] == ["--version"]:
        from fedudp.provenance import version

        print(f"fedudp {version()}")
        return
    if any(a in ("--help", "-h") for a in sys.argv[1:]):  # answered without Hydra (fast)
        print(help_text(), end="")
        return
    argv = resume_in_place(multirun_flag_first(sys.argv[1:]))
    sys.argv[1:] = user_searchpath(argv)
    if not any(a in ("--hydra-help", "--info", "-i") for a in sys.argv[1:]):
        preflight(sys.argv[1:])  # Hydra's help and info compose nothing a job would run
    _hydra_main()


if __name__ == "__main__":
    main()
