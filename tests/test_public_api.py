"""The package's public surface: ``__all__`` on every public module, and the API reference
(docs/api/) listing exactly those names.

The modules checked are every public module of ``fedudp/`` as ``scripts/tools/code_metrics.py``
counts them (no part of the dotted name starts with ``_``; ``__main__`` aside), read from the
tree, one test id per module (``PUBLIC`` below), so a module added or moved is checked at once:

(a) each has ``__all__`` (code_metrics' ``public_modules_without_all`` is empty);
(b) each name of each ``__all__`` exists in the imported module;
(c) the member lists the API pages render, computed as mkdocstrings does (griffe's static view of
    the package, mkdocstrings-python's own ``do_filter_objects``, the options of mkdocs.yml and of
    each directive, the page as docs/hooks.py hands it over), equal ``__all__`` for every module
    the pages document, and every public module is documented on some page.

``fedudp`` itself exports names it loads on first use (``fedudp._API``): each of them must be
rendered in the module it comes from. Weakened twins: a module without ``__all__`` and a page
listing a name more (or a module fewer) are shown caught.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
import textwrap
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
API_PAGES = ROOT / "docs" / "api"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


hooks = _load("fedudp_docs_hooks_api", ROOT / "docs" / "hooks.py")
code_metrics = _load("fedudp_code_metrics_api", ROOT / "scripts" / "tools" / "code_metrics.py")

# every public module of the package (code_metrics' rule, via the docs hook that expands
# "::: fedudp.package.*" with the same rule)
PUBLIC = hooks.public_modules("fedudp", ROOT)


def _path(module: str, root: Path = ROOT) -> str:
    base = root.joinpath(*module.split("."))
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    return path.relative_to(root).as_posix()


def without_all(root: Path) -> list[str]:
    """The public modules of the checkout at ``root`` that have no ``__all__``."""
    return code_metrics.metrics(root)["public_modules_without_all"]


@functools.cache
def _without_all_here() -> frozenset[str]:
    return frozenset(without_all(ROOT))


# -- (a) __all__ everywhere -------------------------------------------------------------------
@pytest.mark.parametrize("module", PUBLIC)
def test_every_public_module_has_all(module):
    assert _path(module) not in _without_all_here(), f"{module}: no __all__"


def test_twin_a_module_without_all_is_caught(tmp_path):
    pkg = tmp_path / "fedudp"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("__all__ = []\n")
    (pkg / "exported.py").write_text("__all__ = ['f']\n\n\ndef f():\n    pass\n")
    (pkg / "_private.py").write_text("def g():\n    pass\n")
    (pkg / "bare.py").write_text("def f():\n    pass\n")  # the weakened module
    assert without_all(tmp_path) == ["fedudp/bare.py"]
    assert "fedudp.bare" in hooks.public_modules("fedudp", tmp_path)


# -- (b) every exported name exists -----------------------------------------------------------
@pytest.mark.parametrize("module", [m for m in PUBLIC if m != "fedudp"])
def test_every_name_in_all_exists(module):
    mod = importlib.import_module(module)
    names = getattr(mod, "__all__", None)
    if names is None:
        pytest.fail(f"{module}: no __all__ (see test_every_public_module_has_all)")
    assert len(set(names)) == len(names), f"{module}: a name twice in __all__"
    assert [n for n in names if not hasattr(mod, n)] == [], module


def test_the_packages_lazy_names_exist():
    import fedudp

    assert sorted(fedudp.__all__) == sorted(fedudp._API)
    for name in fedudp.__all__:
        assert getattr(fedudp, name) is getattr(importlib.import_module(fedudp._API[name]), name)


# -- (c) the API reference --------------------------------------------------------------------
def _global_options() -> dict:
    # mkdocs.yml holds python tags (!!python/object/apply); only the handler's options are read
    text = (ROOT / "mkdocs.yml").read_text()
    loader = yaml.SafeLoader
    loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda *a: None)
    config = yaml.load(text, Loader=loader)  # noqa: S506  (SafeLoader, python tags ignored)
    for plugin in config["plugins"]:
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            return plugin["mkdocstrings"]["handlers"]["python"].get("options", {})
    raise AssertionError("mkdocs.yml: no mkdocstrings handler options")


@functools.cache
def _griffe_package():
    griffe = pytest.importorskip("griffe")
    # as mkdocstrings loads it: the package's own aliases resolved, external ones left
    return griffe.load(
        "fedudp",
        search_paths=[str(ROOT)],
        docstring_parser="numpy",
        resolve_aliases=True,
        resolve_implicit=False,
        resolve_external=False,
    )


def _kind(obj) -> str | None:
    """The member's kind, None for an alias griffe cannot resolve (an external name)."""
    try:
        return obj.kind.value
    except Exception:  # noqa: BLE001  (griffe's AliasResolutionError, CyclicAliasError)
        return None


def _directives(markdown: str):
    """(identifier, options) of each mkdocstrings directive of an expanded page."""
    lines, fence = markdown.splitlines(), None
    for i, line in enumerate(lines):
        f = hooks._FENCE.match(line)
        if f:
            fence = None if fence == f.group(2) else (fence or f.group(2))
            continue
        m = hooks._DIRECTIVE.match(line) if fence is None else None
        if m is None:
            continue
        block = []
        for nxt in lines[i + 1 :]:
            if nxt.strip() and not nxt.startswith((" ", "\t")):
                break
            block.append(nxt)
        parsed = yaml.safe_load(textwrap.dedent("\n".join(block))) or {}
        yield m.group("id"), (parsed.get("options") or {})


def rendered(pages: dict[str, str]) -> tuple[dict[str, set[str]], set[str]]:
    """(module -> the names the pages render as its members, the modules the pages document),
    from the pages' markdown (as docs/hooks.py expands it) the way mkdocstrings-python filters a
    module's members."""
    do_filter_objects = pytest.importorskip("mkdocstrings_handlers.python").do_filter_objects
    pkg = _griffe_package()
    base = _global_options()
    out: dict[str, set[str]] = {}
    documented: set[str] = set()
    for page, text in pages.items():
        for ident, options in _directives(hooks.expand_api(text, ROOT)):
            opts = {**base, **options}
            parts = ident.split(".")
            assert parts[0] == "fedudp", f"{page}: {ident}"
            try:
                obj = pkg if len(parts) == 1 else pkg[".".join(parts[1:])]
            except KeyError:  # mkdocs build fails on it (test_every_directive_names_an_object)
                out.setdefault("", set()).add(f"{page}: ::: {ident}")
                continue
            if not obj.is_module:  # "::: module.Name": one member of that module
                out.setdefault(".".join(parts[:-1]), set()).add(parts[-1])
                continue
            documented.add(ident)
            filters = opts.get("filters", [])
            if isinstance(filters, list):
                filters = [(re.compile(f.lstrip("!")), f.startswith("!")) for f in filters]
            members = opts.get("members")
            objs = do_filter_objects(
                obj.members,
                filters=filters,
                members_list=members,
                inherited_members=opts.get("inherited_members", False),
                keep_no_docstrings=opts.get("show_if_no_docstring", True) or members is not None,
            )
            # the template: submodules only with show_submodules; an imported name only when
            # public (listed in __all__) or named by ``members``
            shown = {
                o.name
                for o in objs
                if _kind(o) not in (None, "module")
                and (filters == "public" or members is not None or not o.is_alias or o.is_public)
            }
            out.setdefault(ident, set()).update(shown)
    return out, documented


@functools.cache
def _rendered_here():
    return rendered(_pages())


def _pages() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(API_PAGES.glob("*.md"))}


def mismatches(pages: dict[str, str], modules: list[str], seen=None) -> list[str]:
    """What the pages get wrong about ``modules``: a module not documented, or documented with
    other names than its ``__all__`` (``seen``: ``rendered(pages)`` when already computed)."""
    got, documented = seen or rendered(pages)
    wrong = []
    for module in modules:
        if module == "fedudp":  # its names are loaded on first use from their own modules
            import fedudp

            wrong += [
                f"fedudp.{n}: not rendered in {fedudp._API[n]}"
                for n in fedudp.__all__
                if n not in got.get(fedudp._API[n], set())
            ]
            continue
        if module not in documented:
            wrong.append(f"{module}: on no page of docs/api/")
            continue
        names = set(getattr(importlib.import_module(module), "__all__", ()))
        if got.get(module, set()) != names:
            more = sorted(got.get(module, set()) - names)
            fewer = sorted(names - got.get(module, set()))
            wrong.append(f"{module}: the pages list {more} more, {fewer} fewer than __all__")
    return wrong


@pytest.mark.parametrize("module", PUBLIC)
def test_the_api_reference_lists_exactly_all(module):
    assert mismatches(_pages(), [module], _rendered_here()) == []


def test_every_directive_names_an_object():
    got, _ = _rendered_here()
    assert sorted(got.get("", ())) == []


def test_twin_a_page_listing_one_name_more_is_caught():
    pages = _pages()
    module = "fedudp.privacy.mechanisms"
    assert mismatches(pages, [module]) == []
    mod = importlib.import_module(module)
    extra = next(  # a function of the module that it does not export
        n
        for n, v in vars(mod).items()
        if callable(v) and getattr(v, "__module__", None) == module and n not in mod.__all__
    )
    pages["twin.md"] = f"# twin\n\n::: {module}.{extra}\n"
    assert mismatches(pages, [module]) == [
        f"{module}: the pages list {[extra]} more, [] fewer than __all__"
    ]


def test_twin_a_page_without_a_module_is_caught():
    pages = _pages()
    pages["accountant.md"] = pages["accountant.md"].replace("::: fedudp.privacy.*", "")
    assert mismatches(pages, ["fedudp.privacy.events"]) == [
        "fedudp.privacy.events: on no page of docs/api/"
    ]


def test_twin_a_member_list_without_one_name_is_caught():
    pages = {"one.md": "::: fedudp.privacy.events\n    options:\n      members: [TAG]\n"}
    assert mismatches(pages, ["fedudp.privacy.events"]) == [
        "fedudp.privacy.events: the pages list [] more, "
        f"{sorted(set(_all('fedudp.privacy.events')) - {'TAG'})} fewer than __all__"
    ]


def _all(module: str) -> list[str]:
    return list(importlib.import_module(module).__all__)


# -- the hook that fills the member lists -----------------------------------------------------
def test_the_hook_fills_members_from_all_and_leaves_the_rest():
    page = (
        "::: fedudp.privacy.events\n\n"
        "::: fedudp.privacy.labels\n    options:\n      show_root_heading: false\n\n"
        "::: fedudp.models.validate\n    options:\n      members: [probe]\n\n"
        "::: fedudp.privacy.events.TAG\n\n"
        "```\n::: fedudp.privacy.events\n```\n"
    )
    got = list(_directives(hooks.expand_api(page, ROOT)))
    assert got == [
        ("fedudp.privacy.events", {"members": _all("fedudp.privacy.events")}),
        (
            "fedudp.privacy.labels",
            {"members": _all("fedudp.privacy.labels"), "show_root_heading": False},
        ),
        ("fedudp.models.validate", {"members": ["probe"]}),  # a list of its own is kept
        ("fedudp.privacy.events.TAG", {}),  # an object, not a module
    ]
    assert hooks.expand_api(page, ROOT).endswith("```\n::: fedudp.privacy.events\n```\n")


def test_the_hook_expands_a_package_into_its_public_modules():
    got = [i for i, _ in _directives(hooks.expand_api("::: fedudp.billboard.*\n", ROOT))]
    assert got == hooks.public_modules("fedudp.billboard", ROOT)
    assert got[0] == "fedudp.billboard" and "fedudp.billboard.server" in got
    assert not [m for m in got if "._" in m]


# -- the built site agrees --------------------------------------------------------------------
@pytest.mark.slow
def test_the_built_site_lists_exactly_all(tmp_path):
    """The rendered pages themselves (``mkdocs build --strict``): each documented module's
    member anchors (``id="module.Name"``) are its ``__all__``, as ``rendered`` computes."""
    import subprocess
    import sys

    pytest.importorskip("mkdocs")
    site = tmp_path / "site"
    mkdocs = Path(sys.executable).with_name("mkdocs")
    done = subprocess.run(
        [str(mkdocs), "build", "--strict", "-q", "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ids: set[str] = set()
    for page in (site / "api").glob("*.html"):
        ids |= set(re.findall(r'id="(fedudp[\w.]*)"', page.read_text()))
    got, documented = _rendered_here()
    assert documented <= ids
    for module in sorted(documented - {"fedudp"}):
        anchors = {
            i[len(module) + 1 :]
            for i in ids
            if i.startswith(module + ".") and "." not in i[len(module) + 1 :] and i not in PUBLIC
        }
        assert anchors == got[module], module
