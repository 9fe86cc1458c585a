"""The GitHub Pages workflow: built by `make build`, the target README names, and `_build/html` published.

`problems()` reads the parsed workflow and lists what is wrong with it; the first test runs it on the file,
the second shows it rejects workflows that publish something else (another target, another folder, a deploy
that does not wait for the build, missing permissions).
"""

import copy
import os
import re
import shlex

import pytest
import yaml

from helpers import ROOT
WORKFLOW = os.path.join(ROOT, ".github", "workflows", "pages.yml")
TARGET = "build"
SITE = "_build/html"


def load() -> dict:
    with open(WORKFLOW) as f:
        return yaml.safe_load(f)


def make_targets(run: str) -> list[list[str]]:
    """The targets of each `make` command in a step's script (variables and options left out)."""
    found = []
    for line in run.splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0] == "make":
            found.append([w for w in words[1:] if not w.startswith("-") and "=" not in w])
    return found


def uses(step: dict, action: str) -> bool:
    return str(step.get("uses", "")).split("@")[0] == action


def problems(wf: dict) -> list[str]:
    out = []
    on = wf.get("on", wf.get(True))  # PyYAML reads a bare `on:` key as True
    on = {on: None} if isinstance(on, str) else (on or {})
    if "main" not in ((on.get("push") or {}).get("branches") or []):
        out.append("not triggered by a push to main")
    if "workflow_dispatch" not in on:
        out.append("cannot be run by hand (workflow_dispatch)")
    jobs = wf.get("jobs") or {}
    builds = [name for name, job in jobs.items()
              if any(uses(s, "actions/upload-pages-artifact") for s in job.get("steps", []))]
    deploys = [name for name, job in jobs.items()
               if any(uses(s, "actions/deploy-pages") for s in job.get("steps", []))]
    if len(builds) != 1 or len(deploys) != 1:
        return out + [f"expected one job uploading the Pages artifact and one deploying it: {builds}, "
                      f"{deploys}"]
    build, deploy = jobs[builds[0]], jobs[deploys[0]]
    steps = build["steps"]
    if not any(uses(s, "actions/checkout") for s in steps):
        out.append("the build job does not check out the repository")
    pythons = [str((s.get("with") or {}).get("python-version"))
               for s in steps if uses(s, "actions/setup-python")]
    if pythons != ["3.11"]:
        out.append(f"the build job sets up Python {pythons}, not 3.11 (README)")
    commands = [(i, t) for i, s in enumerate(steps) for t in make_targets(str(s.get("run", "")))]
    if [t for _, t in commands] != [[TARGET]]:
        out.append(f"the build job runs make {[t for _, t in commands]}, not `make {TARGET}` alone")
    upload = next(i for i, s in enumerate(steps) if uses(s, "actions/upload-pages-artifact"))
    path = os.path.normpath(str((steps[upload].get("with") or {}).get("path", "")))
    if path != SITE:
        out.append(f"the artifact is {path!r}, not {SITE!r}")
    if commands and commands[0][0] > upload:
        out.append("the artifact is uploaded before the book is built")
    needs = deploy.get("needs", [])
    if builds[0] not in ([needs] if isinstance(needs, str) else needs):
        out.append(f"the deploy job does not wait for {builds[0]!r}")
    if (deploy.get("environment") or {}).get("name") != "github-pages":
        out.append("the deploy job is not in the github-pages environment")
    permissions = {**(wf.get("permissions") or {}), **(deploy.get("permissions") or {})}
    for key in ("pages", "id-token"):
        if permissions.get(key) != "write":
            out.append(f"the deploy job lacks `{key}: write`")
    if permissions.get("contents", "read") != "read":
        out.append("the workflow may write to the repository; Pages needs only `contents: read`")
    if not (wf.get("concurrency") or {}).get("group"):
        out.append("two deployments may run at once (no concurrency group)")
    return out


def test_the_workflow_builds_with_make_build_and_publishes_build_html():
    found = problems(load())
    assert not found, "pages.yml: " + "; ".join(found)


def test_the_target_and_the_folder_are_the_ones_readme_and_makefile_use():
    readme = open(os.path.join(ROOT, "README.md")).read()
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    assert re.search(rf"^make {TARGET}\b.*{re.escape(SITE)}", readme, re.M), "README's build command changed"
    recipe = re.search(rf"^{TARGET}:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe and SITE in recipe.group(1), f"`make {TARGET}` no longer says it writes {SITE}"


def _set_run(wf, command):
    step = next(s for s in wf["jobs"]["build"]["steps"] if "run" in s)
    step["run"] = command


def _set_path(wf, path):
    step = next(s for s in wf["jobs"]["build"]["steps"] if uses(s, "actions/upload-pages-artifact"))
    step["with"]["path"] = path


BROKEN = {
    "calls make test": (lambda wf: _set_run(wf, "make test"), "not `make build` alone"),
    "calls make chapter": (lambda wf: _set_run(wf, "make chapter CH=00"), "not `make build` alone"),
    "builds twice": (lambda wf: _set_run(wf, "make build\nmake build"), "not `make build` alone"),
    "calls jupyter-book directly": (lambda wf: _set_run(wf, "jupyter-book build ."),
                                    "not `make build` alone"),
    "uploads _build": (lambda wf: _set_path(wf, "_build"), "the artifact is '_build'"),
    "uploads the chapters": (lambda wf: _set_path(wf, "_build/chapters"), "not '_build/html'"),
    "deploys without waiting": (lambda wf: wf["jobs"]["deploy"].pop("needs"), "does not wait for 'build'"),
    "no id-token": (lambda wf: wf["permissions"].pop("id-token"), "lacks `id-token: write`"),
    "writes contents": (lambda wf: wf["permissions"].update(contents="write"), "only `contents: read`"),
    "only by hand": (lambda wf: wf.update({True: {"workflow_dispatch": None}}) or wf.pop("on", None),
                     "not triggered by a push to main"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_workflow_that_publishes_something_else_is_rejected(name):
    wf = copy.deepcopy(load())
    breaks, message = BROKEN[name]
    breaks(wf)
    found = problems(wf)
    assert any(message in p for p in found), found
