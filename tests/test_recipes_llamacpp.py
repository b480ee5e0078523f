"""The recipe repo's llama.cpp slugs (issue 50): served, rendered flag for flag as the recipe's own compose files at
4a29ab57, GGUF weights pinned by their files, llama-server's own health endpoint and metrics switch.

The expected commands are written out from the upstream files (models/tess-4-27b/llama-cpp/compose/dual/
migtissera-q4km/mtp.yml and models/qwen3.6-40b-deckard/llama-cpp/compose/dual/piehsoft-q6k/mtp.yml, vendored
verbatim in tests/fixtures/club-3090-4a29ab57).
"""

from __future__ import annotations

import shlex
import shutil

import pytest
import yaml
from support import render_variant
from test_recipes import REFERENCE

from rigforge.model import recipes
from rigforge.model.knobs.monitor import Monitor
from rigforge.model.pins import HfFile, HfPin, LockError, parse_lock
from rigforge.model.recipes import RecipeError, parse_repo
from rigforge.model.schema import Settings, apply_overrides

IMAGE = "ghcr.io/ggml-org/llama.cpp:server-cuda-b10236@sha256:" + "ab" * 32
TESS = "llamacpp/tess-dual-mtp"
DECKARD = "llamacpp/deckard40B-dual-mtp"
TESS_DIR = "/models/tess-4-27b-gguf/migtissera-q4km"
SAMPLING = "--temp 0.6 --top-p 0.95 --top-k 20 --min-p 0.0"
DRY = "--dry-multiplier 0.0 --dry-base 1.75 --dry-allowed-length 2"
EXPECTED = {
    TESS: {
        "command": (
            f"--host 0.0.0.0 --port 8080 -m {TESS_DIR}/Tess-4-27B-Q4_K_M.gguf --alias tess-4-27b -c 262144 -b 4096 "
            "-ub 512 -ngl 99 -ts 1,1 -fa on --cache-type-k q4_0 --cache-type-v q4_0 -np 1 "
            f"--spec-draft-model {TESS_DIR}/mtp-Tess-4-27B-Q4_K_M.gguf --spec-type draft-mtp --spec-draft-n-max 2 "
            "--jinja --reasoning off --reasoning-format deepseek --reasoning-budget 16384 "
            f"{SAMPLING} --repeat-penalty 1.0 {DRY}"
        ),
        "port": "0.0.0.0:8115:8080",
        "container": "llama-cpp-tess-4-27b",
        "served": "tess-4-27b",
        "files": ("Tess-4-27B-Q4_K_M.gguf", "mtp-Tess-4-27B-Q4_K_M.gguf"),
    },
    DECKARD: {
        "command": (
            "--host 0.0.0.0 --port 8080 -m /models/qwen3.6-40b-deckard-gguf/piehsoft-q6k/"
            "Qwen3.6-40B-Deckard-MTP-Q6_K.gguf --alias deckard-40b -c 131072 -b 4096 -ub 512 -ngl 99 -ts 1,1 -fa on "
            "--cache-type-k q8_0 --cache-type-v q8_0 -np 1 --spec-type draft-mtp --spec-draft-n-max 2 --jinja "
            f"--reasoning off --reasoning-format deepseek {SAMPLING} --repeat-penalty 1.1 --repeat-last-n 256 {DRY}"
        ),
        "port": "0.0.0.0:8199:8080",
        "container": "llama-cpp-deckard-40b",
        "served": "deckard-40b",
        "files": ("Qwen3.6-40B-Deckard-MTP-Q6_K.gguf",),
    },
}


@pytest.fixture(scope="module")
def repo():
    return parse_repo(REFERENCE)


def render(repo, slug: str, settings: Settings | None = None) -> dict[str, str]:
    return render_variant(recipes.of(repo, repo.recipe(slug), IMAGE), settings or Settings())


def effective(files: dict[str, str]) -> dict:
    """The effective compose as compose reads it: $$ back to a literal $."""
    return recipes._walk(yaml.safe_load(files[recipes.EFFECTIVE_FILE]), lambda s: s.replace("$$", "$"))


@pytest.mark.parametrize("slug", sorted(EXPECTED))
def test_the_production_llamacpp_slugs_render_flag_for_flag_as_the_recipes_compose(repo, slug):
    want, r = EXPECTED[slug], repo.recipes[slug]
    assert (r.status, r.engine, r.engine_type, r.tp, r.refused) == (
        "production",
        "llama-cpp-local",
        "llama.cpp",
        2,
        None,
    )
    files = render(repo, slug)
    name = recipes.service_name(r, repo.compose(r))
    svc = effective(files)["services"][name]
    upstream = recipes.interpolated(repo.compose(r), {})["services"][name]
    assert shlex.split(svc["command"]) == shlex.split(want["command"])  # every flag, in order
    assert shlex.split(upstream["command"]) == shlex.split(want["command"])
    assert svc["entrypoint"] == upstream["entrypoint"]  # the recipe's drafter toggle, byte for byte
    assert svc["entrypoint"][:2] == ["/bin/bash", "-c"] and svc["entrypoint"][-1] == "--"
    assert 'exec /app/llama-server "$@"' in svc["entrypoint"][2]
    assert svc["environment"] == upstream["environment"] == ["SPEC_N=", "SPEC="]
    assert svc["ports"] == [want["port"]]
    assert svc["volumes"] == ["/opt/rigforge/models:/models:ro"]  # MODEL_DIR: the rig's model dir, read-only
    assert svc["container_name"] == want["container"]
    assert svc["deploy"] == upstream["deploy"]
    assert svc["image"] == IMAGE and upstream["image"] == r.image == "ghcr.io/ggml-org/llama.cpp:server-cuda-b10236"
    assert svc["restart"] == "no"  # the unit owns restarts
    override = yaml.safe_load(files[recipes.OVERRIDE_FILE])
    assert override == {"services": {name: {"image": IMAGE, "restart": "no"}}}  # nothing else is rigforge's
    assert files[".env"].splitlines()[1:] == ["MODEL_DIR=/opt/rigforge/models", f"PORT={r.port}"]


@pytest.mark.parametrize("slug", sorted(EXPECTED))
def test_a_llamacpp_slug_serves_its_alias_on_its_health_endpoint_without_metrics(repo, slug):
    v = recipes.of(repo, repo.recipe(slug), IMAGE)
    assert (v.served_model, v.engine, v.health_path) == (EXPECTED[slug]["served"], "llama.cpp", "/health")
    assert v.metrics is False  # neither recipe passes --metrics
    dual = recipes.of(repo, repo.recipe("vllm/dual"), "x")
    assert (dual.engine, dual.health_path, dual.metrics) == ("vllm", "/v1/models", True)


def test_metrics_follow_the_recipes_metrics_flag(repo):
    r = repo.recipe(TESS)
    compose = repo.compose(r)
    svc = next(iter(compose["services"].values()))
    with_metrics = {"services": {"s": {**svc, "command": svc["command"] + " --metrics"}}}
    assert recipes.LiveVariant(r, with_metrics, IMAGE, (), "tess-4-27b", 24000).metrics is True


@pytest.mark.parametrize("slug", sorted(EXPECTED))
def test_gguf_weights_are_the_profiles_files_of_the_repo(repo, slug):
    (w,) = repo.recipes[slug].weights
    assert w.files == EXPECTED[slug]["files"]
    assert recipes.weights_pin(w).include == w.files and "/" not in recipes.weights_pin(w).name


def test_the_llamacpp_recipes_knobs_are_theirs(repo):
    """PORT, BIND_HOST and MODEL_DIR are knobs of the llama.cpp composes; vLLM's max_model_len is not one."""
    s = apply_overrides(Settings(), {"port": 9115, "bind_address": "127.0.0.1"})
    svc = next(iter(effective(render(repo, TESS, s))["services"].values()))
    assert svc["ports"] == ["127.0.0.1:9115:8080"]
    with pytest.raises(RecipeError, match=r"max_model_len' is not exposed .*has no \$\{MAX_MODEL_LEN\}"):
        render(repo, TESS, apply_overrides(Settings(), {"max_model_len": 4096}))


def test_an_engine_rigforge_does_not_serve_is_refused_naming_it_and_what_is_served(tmp_path):
    tree = tmp_path / "club-3090"
    shutil.copytree(REFERENCE, tree, symlinks=True)
    profile = tree / "scripts/lib/profiles/engines/llama-cpp-mainline.yml"
    profile.write_text(profile.read_text().replace("method: docker_image", "method: source_build"))
    ollama = tree / "scripts/lib/profiles/engines/beellama-local.yml"
    ollama.write_text(ollama.read_text().replace("type: llama.cpp", "type: ollama"))
    repo = parse_repo(tree)
    with pytest.raises(RecipeError) as exc:
        repo.recipe(TESS)
    assert str(exc.value) == (
        f"{TESS}: refused: engine llama-cpp-local is llama.cpp installed by source_build: rigforge serves vLLM and "
        "llama.cpp engines installed by docker_image"
    )
    assert repo.recipes["beellama/qwen-mtp-dual"].refused == (
        "engine beellama-local is ollama installed by docker_image: rigforge serves vLLM and llama.cpp engines "
        "installed by docker_image"
    )


def lock_with(hf: dict) -> object:
    """A lock holding the recipe pin at 4a29ab57, the llama.cpp image and the hf entries `hf`."""
    data = {
        "version": 1,
        "image": {"ref": "vllm/vllm-openai:v0", "digest": None},
        "images": {"llama-cpp-local": {"ref": "ghcr.io/ggml-org/llama.cpp:server-cuda-b10236", "digest": None}},
        "git": {
            "recipes": {
                "url": "https://github.com/noonghunna/club-3090.git",
                "ref": "4a29ab57",
                "commit": "4a29ab57d42a1d587de1042fa5dfd9535f94a063",
                "content": recipes.content_digest(REFERENCE),
            }
        },
        "hf": hf,
    }
    return parse_lock(data, "test.lock")


def test_a_slug_takes_the_lock_entry_of_its_files_not_another_quant_of_the_same_repo(monkeypatch):
    monkeypatch.setenv(recipes.RECIPES_ENV, str(REFERENCE))
    other = {"repo": "migtissera/Tess-4-27B-GGUF", "revision": None, "include": ["Tess-4-27B-Q8_0.gguf"]}
    with pytest.raises(LockError) as exc:
        recipes.find(TESS, lock_with({"q8": other}), opt_in=False)
    assert (
        "no hf entry for migtissera/Tess-4-27B-GGUF (files Tess-4-27B-Q4_K_M.gguf, mtp-Tess-4-27B-Q4_K_M.gguf)"
        in str(exc.value)
    )
    assert "include: [Tess-4-27B-Q4_K_M.gguf, mtp-Tess-4-27B-Q4_K_M.gguf]" in str(exc.value)
    mine = {**other, "include": list(EXPECTED[TESS]["files"])}
    v = recipes.find(TESS, lock_with({"q8": other, "q4": mine}), opt_in=False)
    assert v.assets == ("q4",) and v.asset_dirs[0][1] == "tess-4-27b-gguf/migtissera-q4km"
    assert v.image == "ghcr.io/ggml-org/llama.cpp:server-cuda-b10236"  # no digest yet: the tag


def test_lock_resolves_only_the_included_files_of_a_gguf_repo(monkeypatch):
    """`rigforge lock` pins the include's files of a many-quant repo, and refuses one the hub lacks."""
    import huggingface_hub

    from rigforge.cli import lock

    class Sibling:
        def __init__(self, name: str):
            self.rfilename, self.lfs = name, type("Lfs", (), {"size": len(name), "sha256": "e" * 64})()

    class Info:
        sha, gated = "1" * 40, False
        siblings = [
            Sibling(n) for n in ("Tess-4-27B-Q4_K_M.gguf", "Tess-4-27B-Q8_0.gguf", "mtp-Tess-4-27B-Q4_K_M.gguf")
        ]

    class Api:
        def __init__(self, **kwargs):
            pass

        def model_info(self, repo, revision, files_metadata):
            return Info()

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    pin = HfPin(name="q4", repo="migtissera/Tess-4-27B-GGUF", revision=None, include=EXPECTED[TESS]["files"])
    got = lock.resolve_hf(pin, None, None)
    assert got.files == tuple(HfFile(n, len(n), "e" * 64) for n in EXPECTED[TESS]["files"])
    missing = HfPin(name="q4", repo="migtissera/Tess-4-27B-GGUF", revision=None, include=("Tess-4-27B-IQ1.gguf",))
    with pytest.raises(LockError, match=r"hf.q4: migtissera/Tess-4-27B-GGUF@1{40} has no Tess-4-27B-IQ1.gguf"):
        lock.resolve_hf(missing, None, None)


def test_the_monitor_scrapes_a_llamacpp_server_only_when_its_recipe_enables_metrics(repo):
    """A llama.cpp rig is no vLLM target (so no vLLM alert counts it); with --metrics it is a `llamacpp` target,
    labelled serving_engine llama.cpp; the vLLM rig beside it stays a `vllm` target."""
    from types import SimpleNamespace

    from rigforge.model import fleet, monitor
    from rigforge.model.knobs.roles import RoleKnobs

    r = repo.recipe(TESS)
    svc = next(iter(repo.compose(r)["services"].values()))
    plain = recipes.of(repo, r, IMAGE)
    metered = recipes.LiveVariant(
        r, {"services": {"s": {**svc, "command": svc["command"] + " --metrics"}}}, IMAGE, (), "tess-4-27b", 24000
    )

    def plan(host: str, variant) -> SimpleNamespace:
        knobs = RoleKnobs.of({"monitor_node_exporter_port": 9100})
        return SimpleNamespace(host=host, knobs=knobs, port=variant.port, variant=variant)

    dual = recipes.of(repo, repo.recipe("vllm/dual"), "x")
    targets = fleet.targets([plan("rig1", plain), plan("rig2", dual)], {})
    assert targets["vllm"] == (("rig2", "rig2:8010"),) and targets["llamacpp"] == ()
    assert targets["node"] == (("rig1", "rig1:9100"), ("rig2", "rig2:9100"))
    targets = fleet.targets([plan("rig1", metered), plan("rig2", dual)], {})
    assert targets["llamacpp"] == (("rig1", "rig1:8115"),)
    config = yaml.safe_load(monitor.render_config(targets, Monitor(monitor_scrape_interval_s=15)))
    jobs = {job["job_name"]: job["static_configs"] for job in config["scrape_configs"]}
    assert jobs["llamacpp"] == [{"targets": ["rig1:8115"], "labels": {"rig": "rig1", "serving_engine": "llama.cpp"}}]
    assert jobs["vllm"] == [{"targets": ["rig2:8010"], "labels": {"rig": "rig2", "serving_engine": "vllm"}}]


def test_a_ghcr_image_is_asked_at_ghcr_or_at_the_registry_standing_for_upstream():
    from rigforge.cli.lock import manifest_url
    from rigforge.observe.obtain import parse

    ref = "ghcr.io/ggml-org/llama.cpp:server-cuda-b10236"
    assert manifest_url(ref) == "https://ghcr.io/v2/ggml-org/llama.cpp/manifests/server-cuda-b10236"
    assert manifest_url(ref, "http://127.0.0.1:5000") == (
        "http://127.0.0.1:5000/v2/ggml-org/llama.cpp/manifests/server-cuda-b10236"
    )
    assert (
        manifest_url("vllm/vllm-openai:v0.27.1") == "https://registry-1.docker.io/v2/vllm/vllm-openai/manifests/v0.27.1"
    )
    pinned = parse(f"{ref}@sha256:{'ab' * 32}")
    assert (pinned.registry, pinned.repository, pinned.on_docker_hub) == ("ghcr.io", "ggml-org/llama.cpp", False)
    assert pinned.pinned == f"ghcr.io/ggml-org/llama.cpp@sha256:{'ab' * 32}"


def test_in_a_fleet_with_a_registry_a_llamacpp_rig_runs_the_fleets_copy_of_its_ghcr_image(repo):
    """Docker asks mirrors for Docker Hub images only: a rig of a fleet with a registry pulls ghcr.io's image from the
    fleet's copy, by its digest, and its compose files name that copy; the registry host copies the lock's image."""
    from types import SimpleNamespace

    from rigforge.model import fleet
    from rigforge.model.pins import default_lock_path

    variant = recipes.of(repo, repo.recipe(TESS), IMAGE)
    rig = SimpleNamespace(name="rig", groups=("rigs",), data={"rigforge_lock": str(default_lock_path())})
    gw = SimpleNamespace(name="gw", groups=("registry",), data={"registry_address": "10.0.0.5"})
    copy = "10.0.0.5:5000/ghcr.io/ggml-org/llama.cpp:server-cuda-b10236@sha256:" + "ab" * 32

    fl = fleet.build([rig, gw], variant, deployable=False)
    plan = fl.plans["rig"]
    assert plan is not None, fl.problems["rig"]
    assert (plan.image, plan.locked_image) == (copy, IMAGE)
    override = yaml.safe_load(plan.files[recipes.OVERRIDE_FILE])["services"]
    assert {s["image"] for s in override.values()} == {copy}
    assert {s["image"] for s in effective(dict(plan.files))["services"].values()} == {copy}
    assert fl.images == (IMAGE,)  # what the fill copies from ghcr.io

    alone = fleet.build([rig], variant, deployable=False).plans["rig"]  # no fleet registry: from ghcr.io itself
    assert (alone.image, alone.locked_image) == (IMAGE, IMAGE)
    assert {s["image"] for s in effective(dict(alone.files))["services"].values()} == {IMAGE}
