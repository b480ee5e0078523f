"""Recipe-repo slugs (club-3090's registry) as variants: selection, compose interpolation, and the rendered files.

Reads the verbatim reference subset of club-3090 at 4a29ab57 (never modified). The flag-for-flag expectations of
vllm/dual and vllm/qwen-27b-dual-max are written out from the upstream compose files; the generic test compares
every selectable slug with its upstream file interpolated with the file's own defaults. The same files are
cross-checked against a real `docker compose config` in tests/test_recipes_compose_config.py (testbed tier).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support import render_variant

from rigforge.model import recipes
from rigforge.model.recipes import RecipeError, interpolate, parse_repo
from rigforge.model.schema import Settings, SettingsError, apply_overrides

REPO = Path(__file__).resolve().parents[1]
# the verbatim subset of ../shared/reference/club-3090-4a29ab57 (PROVENANCE.md), vendored so CI always has it
REFERENCE = REPO / "tests/fixtures/club-3090-4a29ab57"
IMAGE = "vllm/vllm-openai:v0.27.1@sha256:" + "ab" * 32


@pytest.fixture(scope="module")
def repo():
    return parse_repo(REFERENCE)


def selectable(repo):
    return [s for s, r in repo.recipes.items() if not r.refused and not r.needs_opt_in]


def render(repo, slug, settings=None, opt_in=False):
    r = repo.recipe(slug, opt_in=opt_in)
    return render_variant(recipes.of(repo, r, IMAGE), settings or Settings())


def effective(files) -> dict:
    """The effective compose as compose itself would read it: $$ back to a literal $."""
    data = yaml.safe_load(files[recipes.EFFECTIVE_FILE])
    return recipes._walk(data, lambda s: s.replace("$$", "$"))


# --- selection ---


MULTI4 = (
    "vllm/qwen-27b-multi-fast",
    "vllm/qwen-27b-multi-max",
    "vllm/gemma-31b-multi-google-qat-w4a16",
    "vllm/nemotron-75b-multi-mtp",
)
LLAMACPP = ("llamacpp/tess-dual-mtp", "llamacpp/deckard40B-dual-mtp")  # the production llama.cpp slugs for 2 cards


def test_selectable_slugs_are_vllm_or_llamacpp_docker_production_or_caveats_on_sm86_at_any_tp(repo):
    chosen = selectable(repo)
    assert {"vllm/dual", "vllm/qwen-27b-dual-fast", "vllm/qwen-27b-dual-max", "vllm/minimal", *MULTI4} <= set(chosen)
    assert set(LLAMACPP) <= set(chosen)
    for slug in chosen:
        r = repo.recipes[slug]
        assert r.engine_type in ("vllm", "llama.cpp") and r.install_method == "docker_image" and r.tp >= 1
        assert r.status in ("production", "caveats") and r.required_sm <= 8.6
    assert {repo.recipes[slug].tp for slug in MULTI4} == {4}


def test_a_tp_that_is_not_a_card_count_is_refused():
    for tp in (0, None, "4", True):
        refused = recipes._classify(
            {"tp": tp, "status": "caveats"}, {"type": "vllm", "install": {"method": "docker_image"}}, 8.6
        )
        assert refused == f"tp {tp!r} is not a card count (the registry's tp: how many GPUs the slug runs on)"


@pytest.mark.parametrize(
    "slug, reason",
    [
        ("vllm/gemma-mtp-tp1", "needs sm_90 or newer (fallback_sm/required_sm/min_sm 9.0); an RTX 3090 is sm_86"),
    ],
)
def test_refused_slugs_say_which_and_why_in_one_line(repo, slug, reason):
    with pytest.raises(RecipeError) as exc:
        repo.recipe(slug, opt_in=True)
    msg = str(exc.value)
    assert msg.startswith(f"{slug}: refused: ") and reason in msg and "\n" not in msg


def test_experimental_incubating_and_deprecated_need_an_opt_in(repo):
    for slug in ("vllm/qwen38-27b-dual-fast", "vllm/qwen-27b-dual-balanced"):
        with pytest.raises(RecipeError, match="needs an explicit opt-in"):
            repo.recipe(slug)
        assert repo.recipe(slug, opt_in=True).slug == slug


def test_unknown_slug_is_refused(repo):
    with pytest.raises(RecipeError, match="unknown variant 'vllm/nope'"):
        repo.recipe("vllm/nope")


def test_weights_come_from_the_model_profile(repo):
    (w,) = repo.recipes["vllm/qwen-27b-dual-max"].weights
    assert (w.hf_repo, w.local_subdir, w.size_gb) == ("Qwen/Qwen3.6-27B-FP8", "qwen3.6-27b-fp8", 29.0)
    (w,) = repo.recipes["vllm/dual"].weights
    assert (w.hf_repo, w.local_subdir) == ("Lorbus/Qwen3.6-27B-int4-AutoRound", "qwen3.6-27b-autoround-int4")


# --- the registry's schema as upstream defines it: each test names the upstream file and line it reads ---
# (REFERENCE is a verbatim copy; the lines are those of ../shared/reference/club-3090-4a29ab57/<same path>)


def _line(path: str, line: int) -> str:
    return (REFERENCE / path).read_text().splitlines()[line - 1].strip()


@pytest.mark.parametrize(
    "slug, line, status, opt_in",
    [
        ("vllm/qwen-35b-a3b-dual", 1550, "production", False),
        ("vllm/dual", 74, "caveats", False),
        ("vllm/qwen-35b-a3b-dual-nvfp4", 1608, "experimental", True),
        ("vllm/qwen-27b-dual-lmcache", 158, "incubating", True),
        ("vllm/qwen-27b-dual-balanced", 186, "deprecated", True),
        ("vllm/qwen-a3b-preview-single", 1522, "preview", True),
    ],
)
def test_each_upstream_status_launches_only_with_upstreams_rule(repo, slug, line, status, opt_in):
    """Upstream: only production and caveats launch without --force (here: rigforge_recipe_opt_in)."""
    r = repo.recipes[slug]
    assert r.status == status and r.needs_opt_in is opt_in
    assert _line(recipes.REGISTRY, line) == f"status: {status}"  # registry.yaml:<line>
    if not r.refused:
        if opt_in:
            with pytest.raises(RecipeError, match=f"status {status} needs an explicit opt-in"):
                repo.recipe(slug)
        assert repo.recipe(slug, opt_in=True).slug == slug


def test_required_sm_without_fallback_is_the_floor(repo):
    # registry.yaml:985 (vllm/gemma-mtp-tp1): required_sm 9.0, no fallback_sm
    assert _line(recipes.REGISTRY, 985) == "required_sm: 9.0"
    r = repo.recipes["vllm/gemma-mtp-tp1"]
    assert r.required_sm == 9.0 and r.native_sm is None and "needs sm_90" in r.refused


def test_fallback_sm_replaces_required_sm_as_the_floor(repo):
    # registry.yaml:305-306 (vllm/qwen-27b-dual-nvfp4): required_sm 9.0, fallback_sm 7.5; the rule is
    # scripts/preflight.sh:483 "fallback_sm replaces required_sm as the hard floor" (live-validated on 2x 3090)
    assert (_line(recipes.REGISTRY, 305), _line(recipes.REGISTRY, 306)) == ("required_sm: 9.0", "fallback_sm: 7.5")
    assert "fallback_sm replaces required_sm as the" in _line("scripts/preflight.sh", 483)
    r = repo.recipes["vllm/qwen-27b-dual-nvfp4"]
    assert (r.required_sm, r.native_sm, r.refused) == (7.5, 9.0, None)


def test_engine_min_sm_raises_the_floor(repo):
    # scripts/lib/profiles/engines/vllm-diffusion-gemma.yml:15 min_sm 8.0 (the registry row has no required_sm)
    assert _line("scripts/lib/profiles/engines/vllm-diffusion-gemma.yml", 15) == "min_sm: 8.0"
    assert repo.recipes["vllm/diffusiongemma-dual"].required_sm == 8.0


def test_category_is_kept(repo):
    # registry.yaml:1729 (llamacpp/deckard40B-dual-mtp) category: uncensored
    assert _line(recipes.REGISTRY, 1729) == "category: uncensored"
    assert repo.recipes["llamacpp/deckard40B-dual-mtp"].category == "uncensored"
    assert repo.recipes["vllm/dual"].category is None


def test_default_arch_allow_is_kept(repo):
    # registry.yaml:534-535 (beellama/dflash) default_arch_allow: ["8.6"]
    assert (_line(recipes.REGISTRY, 534), _line(recipes.REGISTRY, 535)) == ("default_arch_allow:", '- "8.6"')
    assert repo.recipes["beellama/dflash"].default_arch_allow == ("8.6",)
    assert repo.recipes["vllm/dual"].default_arch_allow == ()


def test_sampler_profiles_are_kept(repo):
    # registry.yaml:2292-2306 (llamacpp/qwen38-27b-single-iq4xs) sampler_profiles: instruct, thinking
    assert _line(recipes.REGISTRY, 2292) == "sampler_profiles:"
    profiles = repo.recipes["llamacpp/qwen38-27b-single-iq4xs"].sampler_profiles
    assert profiles["instruct"]["presence_penalty"] == 1.5 and profiles["thinking"]["temperature"] == 1.0
    assert repo.recipes["vllm/dual"].sampler_profiles == {}


# --- compose interpolation (the compose spec's rules) ---


@pytest.mark.parametrize(
    "text, expected",
    [
        ("${SET}", "value"),
        ("$SET/x", "value/x"),
        ("${UNSET}", ""),
        ("${UNSET:-d}", "d"),
        ("${EMPTY:-d}", "d"),
        ("${EMPTY-d}", ""),
        ("${UNSET-d}", "d"),
        ("${SET:+alt}", "alt"),
        ("${EMPTY:+alt}", ""),
        ("${EMPTY+alt}", "alt"),
        ("${UNSET:-${FALLBACK:-x}}", "fallback"),
        ("${UNSET:-${ALSO_UNSET:-inner}}", "inner"),
        ("$${SET:-3}", "${SET:-3}"),
        ("$$SET", "$SET"),
        ("a$ b $1", "a$ b $1"),
        ('{"t":${T:-${TT:-0.6}}}', '{"t":0.6}'),
    ],
)
def test_interpolation_follows_the_compose_spec(text, expected):
    env = {"SET": "value", "EMPTY": "", "FALLBACK": "fallback"}
    assert interpolate(text, env) == expected


def test_required_variable_is_an_error():
    with pytest.raises(RecipeError, match="required variable X is missing: set it"):
        interpolate("${X:?set it}", {})


# --- the rendered files, flag for flag ---

DUAL_COMMAND = [
    "--model", "/root/.cache/huggingface/qwen3.6-27b-autoround-int4",
    "--served-model-name", "qwen3.6-27b", "qwen3.6-27b-autoround",
    "--quantization", "auto_round", "--dtype", "float16",
    "--tensor-parallel-size", "2", "--pipeline-parallel-size", "1",
    "--max-model-len", "262144", "--gpu-memory-utilization", "0.92", "--max-num-seqs", "2",
    "--max-num-batched-tokens", "8192", "--kv-cache-dtype", "fp8_e4m3", "--trust-remote-code",
    "--chat-template", "/etc/qwen-froggeric-chat-template.jinja", "--reasoning-parser", "qwen3",
    "--default-chat-template-kwargs", '{"enable_thinking": false}',
    "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder",
    "--enable-prefix-caching", "--enable-chunked-prefill", "--long-prefill-token-threshold", "2048",
    "--override-generation-config",
    '{"temperature":0.6,"top_p":0.95,"top_k":20,"min_p":0.0,"repetition_penalty":1.0}',
    "--host", "0.0.0.0", "--port", "8000",
]  # fmt: skip
DUAL_MAX_COMMAND = [
    "--model", "/root/.cache/huggingface/qwen3.6-27b-fp8",
    "--served-model-name", "qwen3.6-27b", "qwen3.6-27b-autoround",
    "--quantization", "fp8", "--dtype", "bfloat16",
    "--tensor-parallel-size", "2", "--pipeline-parallel-size", "1",
    "--max-model-len", "262144", "--gpu-memory-utilization", "0.92", "--max-num-seqs", "2",
    "--max-num-batched-tokens", "8192", "--kv-cache-dtype", "fp8", "--trust-remote-code",
    "--chat-template", "/etc/qwen-froggeric-chat-template.jinja", "--reasoning-parser", "qwen3",
    "--default-chat-template-kwargs", '{"enable_thinking": false}',
    "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder",
    "--enable-prefix-caching", "--enable-chunked-prefill",
    "--override-generation-config",
    '{"temperature":0.6,"top_p":0.95,"top_k":20,"min_p":0.0,"repetition_penalty":1.0}',
    "--host", "0.0.0.0", "--port", "8000",
]  # fmt: skip
COMMON_ENV = {
    "SPEC_N": "",
    "SPEC": "",
    "NVIDIA_VISIBLE_DEVICES": "all",
    "CUDA_VISIBLE_DEVICES": None,
    "HUGGING_FACE_HUB_TOKEN": "",
    "HF_HUB_OFFLINE": "0",
    "TRANSFORMERS_OFFLINE": "0",
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    "NVLINK_MODE": "auto",
    "VLLM_SKIP_P2P_CHECK": None,
    "NCCL_CUMEM_ENABLE": "0",
    "NCCL_P2P_DISABLE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "OMP_NUM_THREADS": "1",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:512",
}
SRC = "/opt/rigforge/src/recipes"
PATCHES = f"{SRC}/models/qwen3.6-27b/vllm/patches"
COMMON_VOLUMES = [
    "/opt/rigforge/models:/root/.cache/huggingface",
    "/opt/rigforge/cache/torch_compile:/root/.cache/vllm/torch_compile_cache",
    "/opt/rigforge/cache/triton:/root/.triton/cache",
    f"{PATCHES}/froggeric-chat-template/chat_template.jinja:/etc/qwen-froggeric-chat-template.jinja:ro",
    f"{SRC}/scripts/detect_nvlink.sh:/etc/club3090/detect_nvlink.sh:ro",
    f"{PATCHES}/vllm-pr48375-mamba-drop-eagle-block:/etc/club3090/pr48375:ro",
]
EXPECTED = {
    "vllm/dual": {
        "command": DUAL_COMMAND,
        "env": {**COMMON_ENV, "VLLM_MARLIN_INPUT_DTYPE": None},
        "volumes": [*COMMON_VOLUMES[:4], f"{PATCHES}/w4a8-int8-act:/etc/club3090/w4a8:ro", *COMMON_VOLUMES[4:]],
        "port": "0.0.0.0:8010:8000",
        "container": "vllm-qwen36-27b-dual",
        "script_starts": "bash /etc/club3090/w4a8/install.sh || exit 1",
    },
    "vllm/qwen-27b-dual-max": {
        "command": DUAL_MAX_COMMAND,
        "env": {**COMMON_ENV, "VLLM_USE_DEEP_GEMM": None},
        "volumes": COMMON_VOLUMES,
        "port": "0.0.0.0:8013:8000",
        "container": "vllm-qwen36-27b-dual-max",
        "script_starts": "source /etc/club3090/detect_nvlink.sh",
    },
}


def env_map(entries) -> dict:
    if isinstance(entries, dict):
        return entries
    return {e.partition("=")[0]: (e.partition("=")[2] if "=" in e else None) for e in entries}


def script_lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.strip() and not line.strip().startswith("#")]


@pytest.mark.parametrize("slug", sorted(EXPECTED))
def test_effective_compose_is_the_recipe_flag_for_flag(repo, slug):
    want = EXPECTED[slug]
    svc = next(iter(effective(render(repo, slug))["services"].values()))
    assert svc["image"] == IMAGE and IMAGE.startswith("vllm/vllm-openai:v0.27.1@")  # the lock's image, by digest
    assert svc["command"] == want["command"]
    assert env_map(svc["environment"]) == want["env"]
    assert svc["volumes"] == want["volumes"]
    assert svc["ports"] == [want["port"]]
    assert (svc["ipc"], svc["shm_size"], svc["restart"], svc["container_name"]) == (
        "host",
        "16gb",
        "no",
        want["container"],
    )
    assert svc["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}
    ]
    bash, dash_c, script, dashes = svc["entrypoint"]
    assert (bash, dash_c, dashes) == ("bash", "-c", "--")
    lines = script_lines(script)
    assert lines[0] == want["script_starts"]
    assert '_spec_n="${SPEC_N:-3}"' in lines  # the recipe's own shell, not compose-interpolated
    assert lines[-2].strip() == (
        'exec vllm serve ${VLLM_ENFORCE_EAGER:+--enforce-eager} --disable-custom-all-reduce "$@" "${SPEC_ARGS[@]}"'
    )


@pytest.fixture(scope="module")
def every_selectable(repo):
    return selectable(repo)


@pytest.fixture(scope="module")
def repo_b(tmp_path_factory):
    """The recipe repo one bump later (the testbed's commit B, rigforge/testbed/recipe_commits.py): its engine at
    a new image with upstream's `image_env`, a flag's default changed, a new slug with new weights."""
    from rigforge.testbed import recipe_commits

    tree = tmp_path_factory.mktemp("recipes-b") / "club-3090"
    shutil.copytree(REFERENCE, tree, symlinks=True)
    recipe_commits.to_b(tree)
    return parse_repo(tree)


def test_a_later_commit_renders_every_selectable_slug_with_no_code_change(repo, repo_b):
    from rigforge.testbed.recipe_commits import B_IMAGE, NEW_SLUG

    assert set(selectable(repo_b)) == set(selectable(repo)) | {NEW_SLUG}
    test_every_selectable_slug_matches_its_upstream_file_with_its_own_defaults(repo_b, selectable(repo_b))
    dual = repo_b.recipes["vllm/dual"]
    assert (dual.image, dual.image_env) == (B_IMAGE, "VLLM_IMAGE")
    files = render(repo_b, "vllm/dual")
    assert f"VLLM_IMAGE={IMAGE}" in files[".env"]  # the lock's image, set the recipe's way
    svc = effective(files)["services"][recipes.service_name(dual, repo_b.compose(dual))]
    assert svc["command"][svc["command"].index("--max-num-batched-tokens") + 1] == "16384"
    new = repo_b.recipes[NEW_SLUG]
    assert [w.hf_repo for w in new.weights] == ["Lorbus/Qwen3.6-27B-int4-AutoRound-v2"]


def test_every_selectable_slug_matches_its_upstream_file_with_its_own_defaults(repo, every_selectable):
    assert len(every_selectable) >= 3
    for slug in every_selectable:
        r = repo.recipes[slug]
        upstream = repo.compose(r)
        name = recipes.service_name(r, upstream)
        up = recipes.interpolated(upstream, {})["services"][name]
        svc = effective(render(repo, slug))["services"][name]
        assert svc["image"] == IMAGE, slug
        assert up["image"] == r.image, slug  # the engine profile's image, which the lock pins
        for key in ("command", "entrypoint", "ipc", "shm_size", "container_name", "deploy"):
            assert svc.get(key) == up.get(key), (slug, key)
        assert env_map(svc["environment"]) == env_map(up["environment"]), slug
        assert sorted(v.split(":")[1] for v in svc["volumes"]) == sorted(v.split(":")[1] for v in up["volumes"])
        assert [p.rsplit(":", 1)[1] for p in svc["ports"]] == [p.rsplit(":", 1)[1] for p in up["ports"]]
        assert svc["ports"][0].split(":")[1] == str(r.port), slug  # the registry's default_port is the file's
        for v in svc["volumes"]:
            assert v.startswith("/"), (slug, v)  # every host path absolute: models, caches, the rig's checkout
        assert svc["restart"] == "no"


def test_host_settings_map_onto_the_recipe_knobs(repo):
    s = apply_overrides(
        Settings(),
        {
            "port": 8111,
            "bind_address": "127.0.0.1",
            "model_dir": "/data/models",
            "max_model_len": 131072,
            "kv_cache_dtype": "fp8_e5m2",
            "gpu_memory_utilization": 0.82,
            "max_num_seqs": 1,
            "spec_n": 0,
            "nvlink_mode": "force_off",
            "hf_token": "hf_" + "s" * 34,
        },
    )
    files = render(repo, "vllm/dual", s)
    env = dict(line.split("=", 1) for line in files[".env"].splitlines() if not line.startswith("#"))
    assert env == {
        "PORT": "8111",
        "BIND_HOST": "127.0.0.1",
        "MODEL_DIR": "/data/models",
        "MAX_MODEL_LEN": "131072",
        "KV_CACHE_DTYPE": "fp8_e5m2",
        "GPU_MEMORY_UTILIZATION": "0.82",
        "MAX_NUM_SEQS": "1",
        "SPEC_N": "0",
        "NVLINK_MODE": "force_off",
    }
    svc = next(iter(effective(files)["services"].values()))
    cmd = svc["command"]
    for flag, value in (
        ("--max-model-len", "131072"),
        ("--kv-cache-dtype", "fp8_e5m2"),
        ("--gpu-memory-utilization", "0.82"),
        ("--max-num-seqs", "1"),
    ):
        assert cmd[cmd.index(flag) + 1] == value
    assert svc["ports"] == ["127.0.0.1:8111:8000"] and svc["volumes"][0] == "/data/models:/root/.cache/huggingface"
    assert {"SPEC_N=0", "NVLINK_MODE=force_off"} <= set(svc["environment"])
    token = "hf_" + "s" * 34
    assert all(token not in text for text in files.values())  # the weights are fetched: no file holds the token
    assert "- HUGGING_FACE_HUB_TOKEN=\n" in files[recipes.EFFECTIVE_FILE]  # the container gets no token


@pytest.mark.parametrize(
    "slug, key, value, var",
    [
        ("vllm/qwen-27b-dual-max", "max_num_seqs", 4, "MAX_NUM_SEQS"),  # hard-coded "2" in that recipe
        ("vllm/qwen-35b-a3b-dual", "spec_n", 0, "SPEC_N"),
        ("vllm/dual", "extra_args", ["--enable-log-requests"], None),
        ("vllm/dual", "api_key", "k-1", None),
    ],
)
def test_a_knob_the_recipe_does_not_expose_is_refused(repo, slug, key, value, var):
    with pytest.raises(RecipeError) as exc:
        render(repo, slug, apply_overrides(Settings(), {key: value}))
    assert f"{slug}: setting {key!r} is not exposed" in str(exc.value)
    if var:
        assert "${" + var + "}" in str(exc.value)


def test_recipe_only_settings_are_refused_for_seed_variants():
    from rigforge.model.catalog import load_catalog

    with pytest.raises(SettingsError, match="'spec_n' cannot be used with dual"):
        render_variant(load_catalog().variants["dual"], apply_overrides(Settings(), {"spec_n": 0}))


def test_serve_dir_runs_the_recipe_file_from_the_rig_checkout(repo):
    files = render(repo, "vllm/qwen-27b-dual-max", apply_overrides(Settings(), {"root": "/srv/rf"}))
    wrapper = yaml.safe_load(files[recipes.COMPOSE_FILE])
    assert wrapper == {
        "name": "rigforge-vllm-qwen-27b-dual-max",
        "include": [
            {
                "path": [
                    "/srv/rf/src/recipes/models/qwen3.6-27b/vllm/compose/dual/fp8/mtp.yml",
                    "compose.override.yml",
                ],
                "env_file": ".env",
            }
        ],
    }
    host = yaml.safe_load(files[recipes.OVERRIDE_FILE])["services"]["vllm-qwen36-27b-dual"]
    assert host == {
        "image": IMAGE,
        "restart": "no",
        "volumes": [
            "/srv/rf/cache/torch_compile:/root/.cache/vllm/torch_compile_cache",
            "/srv/rf/cache/triton:/root/.triton/cache",
        ],
    }


# --- the command line ---


def cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "rigforge.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "RIGFORGE_RECIPES": str(REFERENCE), **(env or {})},
    )


def test_render_list_shows_seeds_first_then_live_slugs_with_port_weights_status():
    r = cli("render", "--list")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()[1:]
    assert [line.split()[0] for line in lines[:5]] == [
        "dual",
        "dual-turbo",
        "dual-dflash",
        "dual-dflash-noviz",
        "carnice-bf16mtp",
    ]
    dual = next(line for line in lines if line.startswith("vllm/dual "))
    assert dual.split()[:4] == ["vllm/dual", "8010", "caveats", "yes"] and "Lorbus/Qwen3.6-27B-int4-AutoRound" in dual
    dual_max = next(line for line in lines if line.startswith("vllm/qwen-27b-dual-max "))
    assert dual_max.split()[:4] == ["vllm/qwen-27b-dual-max", "8013", "caveats", "yes"] and "29 GB" in dual_max
    nvfp4 = next(line for line in lines if line.startswith("vllm/gemma-mtp-tp1 "))
    assert "refused: needs sm_90" in nvfp4


def test_render_slug_writes_rig_files_and_the_effective_compose(tmp_path):
    r = cli("render", "vllm/dual", "--out", str(tmp_path), env={"RIGFORGE_HF_TOKEN": "hf_" + "z" * 34})
    assert r.returncode == 0, r.stderr
    names = {p.name for p in tmp_path.iterdir()}
    assert {
        "docker-compose.yml",
        "compose.override.yml",
        ".env",
        "effective-compose.yml",
        "rigforge-vllm@.service",
        "rigforge-gpu-power.service",
    } <= names
    assert (tmp_path / ".env").stat().st_mode & 0o777 == 0o600
    assert "hf_" + "z" * 34 not in r.stdout + r.stderr


def test_render_refusals_are_one_line_with_exit_2(tmp_path):
    r = cli("render", "vllm/gemma-mtp-tp1", "--out", str(tmp_path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "vllm/gemma-mtp-tp1: refused" in r.stderr


def test_without_a_recipe_repo_a_live_slug_is_refused_with_how_to_get_it(tmp_path):
    r = cli(
        "render", "vllm/dual", "--out", str(tmp_path), env={"RIGFORGE_RECIPES": "", "XDG_CACHE_HOME": str(tmp_path)}
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "set RIGFORGE_RECIPES=DIR" in r.stderr and "rigforge lock" in r.stderr


def test_every_selectable_slug_renders_without_a_lock_entry_showing_its_unresolved_pins(
    repo, tmp_path, monkeypatch, capsys
):
    """`render` needs no lock entry for a slug's image or weights (issue 33): each selectable slug, opt-in ones
    too, renders with its engine's image by tag, and the pins the lock lacks are named as unresolved."""
    from rigforge.cli.main import main
    from rigforge.model.pins import default_lock_path, load_lock

    monkeypatch.setenv("RIGFORGE_RECIPES", str(REFERENCE))
    lock = load_lock(default_lock_path())
    slugs = [s for s, r in repo.recipes.items() if not r.refused]
    assert len(slugs) >= 12
    lacking = 0
    for slug in slugs:
        rc = main(["render", slug, "--opt-in", "--out", str(tmp_path / slug)])
        out = capsys.readouterr()
        assert rc == 0, (slug, out.err)
        recipe = repo.recipes[slug]
        svc = next(iter(yaml.safe_load((tmp_path / slug / recipes.EFFECTIVE_FILE).read_text())["services"].values()))
        assert svc["image"] == lock.pinned(recipe.image), slug
        missing = [w.hf_repo for w in recipe.weights if not any(p.repo == w.hf_repo for p in lock.hf.values())]
        for hf_repo in missing:
            assert f" {hf_repo} (revision: null)" in out.out, (slug, out.out)
        lacking += bool(missing)
    assert lacking >= 9  # most slugs' weights are not in the shipped lock: they rendered anyway


def test_a_deploy_still_refuses_a_slug_the_lock_lacks(monkeypatch):
    from rigforge.model import fleet
    from rigforge.model.fleet import build_plan as build
    from rigforge.model.pins import default_lock_path

    monkeypatch.setenv("RIGFORGE_RECIPES", str(REFERENCE))
    data = fleet.host_data({"rigforge_lock": str(default_lock_path())})
    plan, problems = build("rig", data, "vllm/gemma-31b-dual")
    assert plan is None and problems and "no hf entry for cyankiwi/gemma-4-31B-it-qat-AWQ-INT4" in problems[-1]
    plan, problems = build("rig", data, "vllm/gemma-31b-dual", deployable=False)
    assert problems == [] and not plan.assets[0].pin.resolved


def test_a_plan_names_what_a_variant_cannot_take_by_host_data_key_with_every_other_problem(monkeypatch):
    """The variant's setting check and its files are one call (fleet.build_plan); its problem is still named as
    the host-data key, for a slug and a seed alike, and reported with the plan's other problems."""
    from rigforge.model import fleet
    from rigforge.model.pins import default_lock_path

    monkeypatch.setenv("RIGFORGE_RECIPES", str(REFERENCE))
    base = {"rigforge_lock": str(default_lock_path()), "serving_port": 22}
    data = fleet.host_data({**base, "serving_api_key": "k1"})
    plan, problems = fleet.build_plan("rig", data, "vllm/dual", deployable=False)
    assert plan is None and len(problems) == 2, problems
    assert "serving_api_key" in problems[0] and "setting 'api_key'" not in problems[0]
    assert problems[1].startswith("serving_port 22 is this rig's SSH port")
    data = fleet.host_data({**base, "serving_kv_cache_dtype": "fp8_e5m2"})
    plan, problems = fleet.build_plan("rig", data, "dual-dflash", deployable=False)
    assert plan is None and problems[0].startswith("serving_kv_cache_dtype cannot be used with dual-dflash")
    assert problems[1].startswith("serving_port 22 is this rig's SSH port")


# --- a slug for a deploy: lock entries by image ref and repo id ---


def test_served_model_and_min_card_mib_read_the_compose_file():
    def compose(*command):
        return {"services": {"svc": {"command": list(command)}}}

    assert recipes.served_model(compose("serve", "--served-model-name", "a", "--served-model-name", "b")) == "a"
    assert recipes.served_model(compose("--model", "m.gguf", "--alias", "c")) == "c"  # llama-server
    assert recipes.served_model(compose("--model", "m.gguf", "-a", "d")) == "d"
    assert recipes.served_model(compose("serve", "--served-model-name")) is None  # no value: none named
    assert recipes.served_model({"services": {"svc": {}}}) is None
    assert recipes.min_card_mib("# Requires-min-vram-gb: 22.5\nservices: {}\n") == 22500  # the seed's MiB terms
    assert recipes.min_card_mib("services: {}\n") == 24000


def test_a_slug_takes_its_image_and_weights_from_the_lock(monkeypatch):
    import dataclasses

    from rigforge.model.pins import LockError, default_lock_path, load_lock

    monkeypatch.setenv("RIGFORGE_RECIPES", str(REFERENCE))
    lock = load_lock(default_lock_path())
    v = recipes.find("vllm/qwen-27b-dual-max", lock, opt_in=False)
    assert (v.name, v.gpus, v.port, v.sources, v.assets) == (
        "vllm-qwen-27b-dual-max",
        2,
        8013,
        ("recipes",),
        ("qwen3.6-27b-fp8",),
    )
    assert v.asset_dirs == (("qwen3.6-27b-fp8", "qwen3.6-27b-fp8", 29 * 10**9),)
    assert v.image == "vllm/vllm-openai:v0.27.1" and v.served_model == "qwen3.6-27b"
    assert v.min_card_mib == 24000  # the compose header's Requires-min-vram-gb: 24
    digest = "sha256:" + "e" * 64
    pinned = dataclasses.replace(
        lock, images={"vllm-stable": dataclasses.replace(lock.images["vllm-stable"], digest=digest)}
    )
    v = recipes.find("vllm/dual", pinned, opt_in=False)
    assert v.image == f"vllm/vllm-openai:v0.27.1@{digest}"
    assert f"image: vllm/vllm-openai:v0.27.1@{digest}" in render_variant(v, Settings())[recipes.OVERRIDE_FILE]
    no_weights = dataclasses.replace(lock, hf={k: p for k, p in lock.hf.items() if p.repo != "Qwen/Qwen3.6-27B-FP8"})
    with pytest.raises(
        LockError, match=r"no hf entry for Qwen/Qwen3.6-27B-FP8 \(vllm/qwen-27b-dual-max\): add hf.qwen3.6-27b-fp8"
    ):
        recipes.find("vllm/qwen-27b-dual-max", no_weights, opt_in=False)
    with pytest.raises(LockError, match="no image entry for vllm/vllm-openai:v0.27.1"):
        recipes.find("vllm/dual", dataclasses.replace(lock, images={}), opt_in=False)


def test_every_setting_a_recipe_cannot_take_is_named_at_once(repo):
    r = repo.recipe("vllm/qwen-27b-dual-max")
    values = {"max_num_seqs": 4, "api_key": "k1", "max_model_len": 4096}
    with pytest.raises(RecipeError) as exc:
        recipes.knob_env(r, repo.compose(r), values, host_keys=True)
    assert "vllm/qwen-27b-dual-max: serving_max_num_seqs, serving_api_key are not exposed" in str(exc.value)
    assert "${MAX_NUM_SEQS}, no knob for api_key" in str(exc.value) and "remove them" in str(exc.value)


# --- a newer registry: the reader bends with the schema (issue 33) ---


@pytest.fixture(scope="module")
def newer(tmp_path_factory):
    """The vendored subset as upstream moved it on: vllm-stable names `image_env: VLLM_IMAGE` (its composes read
    `${VLLM_IMAGE:-...}`), vllm/dual gains keys rigforge does not read and a null mem_util, and two entries
    arrive that rigforge cannot serve: a new status and a new engine."""
    import shutil

    root = tmp_path_factory.mktemp("newer") / "club-3090"
    shutil.copytree(REFERENCE, root)
    engines = root / "scripts/lib/profiles/engines"
    (engines / "vllm-stable.yml").write_text((engines / "vllm-stable.yml").read_text() + "image_env: VLLM_IMAGE\n")
    (engines / "sglang-stable.yml").write_text(
        "id: sglang-stable\ntype: sglang\ninstall:\n  method: docker_image\n  spec: lmsysorg/sglang:v0.5\nmin_sm: 8.0\n"
    )
    path = root / recipes.REGISTRY
    registry = yaml.safe_load(path.read_text())
    dual = registry["entries"]["vllm/dual"]
    dual.update(mem_util=None, origin="club-3090", kv_offload="opt-in", spec_method="mtp", supported_sm=[8.6])
    registry["entries"]["vllm/dual-preview2"] = {**dual, "status": "preview-2", "default_port": 8201}
    registry["entries"]["sglang/qwen-27b-dual"] = {**dual, "engine": "sglang-stable", "default_port": 8202}
    path.write_text(yaml.safe_dump(registry, sort_keys=False))
    return parse_repo(root)


def test_unknown_entry_keys_are_kept_as_data_and_a_null_keeps_the_compose_files_value(repo, newer):
    r = newer.recipes["vllm/dual"]
    assert r.extra["origin"] == "club-3090" and r.extra["kv_offload"] == "opt-in" and r.extra["mem_util"] is None
    assert r.extra["supported_sm"] == [8.6] and "status" not in r.extra and "compose_path" not in r.extra
    old = next(iter(effective(render(repo, "vllm/dual"))["services"].values()))
    new = next(iter(effective(render(newer, "vllm/dual"))["services"].values()))
    assert new["command"] == old["command"]  # mem_util null: --gpu-memory-utilization stays the compose file's
    assert env_map(new["environment"]) == env_map(old["environment"])


def test_new_statuses_and_engines_are_refused_with_the_reason(newer):
    assert newer.recipes["vllm/dual-preview2"].refused == "unknown status 'preview-2'"
    assert newer.recipes["sglang/qwen-27b-dual"].refused == (
        "engine sglang-stable is sglang installed by docker_image: rigforge serves vLLM and llama.cpp engines "
        "installed by docker_image"
    )
    with pytest.raises(RecipeError, match="vllm/dual-preview2: refused: unknown status 'preview-2'"):
        newer.recipe("vllm/dual-preview2", opt_in=True)


def test_the_image_is_set_the_recipes_way_through_its_image_env(repo, newer):
    """With the engine's image_env, the lock's image goes into .env as VLLM_IMAGE and the override leaves the
    image alone: the compose file the rig runs is the recipe's own; the vendored engine (no image_env) keeps the
    override's image, as before."""
    files = render(newer, "vllm/dual")
    assert f"VLLM_IMAGE={IMAGE}" in files[".env"].splitlines()
    assert "image" not in yaml.safe_load(files[recipes.OVERRIDE_FILE])["services"]["vllm-qwen36-27b-dual"]
    assert next(iter(effective(files)["services"].values()))["image"] == IMAGE
    vendored = render(repo, "vllm/dual")
    assert "VLLM_IMAGE=" not in vendored[".env"]
    assert yaml.safe_load(vendored[recipes.OVERRIDE_FILE])["services"]["vllm-qwen36-27b-dual"]["image"] == IMAGE


def test_follow_derives_the_engine_image_a_second_image_and_the_weights_from_the_later_commit(tmp_path):
    """rigforge/cli/follow.py on commit B (with a compose that also pulls a kernel image by digest): the engine's entry
    moves to B's image, unresolved; the second image gets its own entry with its digest; the new slug's weights an
    unresolved hf entry; the recipe pin moves to the fetched commit. Entries nothing uses are left as they were."""
    import dataclasses

    from rigforge.cli import follow
    from rigforge.model.pins import GitPin, ImagePin, Lock
    from rigforge.testbed import recipe_commits

    tree = tmp_path / "club-3090"
    shutil.copytree(REFERENCE, tree, symlinks=True)
    recipe_commits.to_b(tree)
    compose = tree / recipe_commits.NEW_COMPOSE
    kernel = "club3090/kernels:v2@sha256:" + "c3" * 32
    compose.write_text(compose.read_text() + f"  kernels:\n    image: {kernel}\n")
    old = ImagePin(ref="vllm/vllm-openai:v0.27.1", digest="sha256:" + "a1" * 32, cuda="13.0")
    pin = GitPin(name="recipes", url="file:///recipes.git", ref="A", commit="a" * 40)
    lock = Lock(path="lock.yaml", image=old, git={"recipes": pin}, hf={}, images={"vllm-stable": old})
    fetched = []

    def fetch(p):
        fetched.append(p)
        return dataclasses.replace(p, commit="b" * 40), tree

    new, repo = follow.follow(lock, "B", [recipe_commits.NEW_SLUG], fetch)
    assert fetched[0].ref == "B" and fetched[0].commit is None
    assert new.git["recipes"].commit == "b" * 40 and new.git["recipes"].ref == "B"
    assert new.images["vllm-stable"] == ImagePin(ref=recipe_commits.B_IMAGE, cuda="13.0")  # to be resolved
    assert new.images["kernels"] == ImagePin(ref="club3090/kernels:v2", digest="sha256:" + "c3" * 32)
    assert [(p.repo, p.revision) for p in new.hf.values()] == [(recipe_commits.NEW_REPO, None)]
    assert "+    ref: vllm/vllm-openai:v0.31.0" in follow.diff(lock, new, "lock.yaml")
