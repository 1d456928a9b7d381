#!/usr/bin/env bash
# The compose cluster, run for real (issue 32): build the CPU image from this checkout, start redis + verifier +
# drafter + gateway with docker-compose.yml's `cpu` profile, answer a chat through the OpenAI port and a generation
# over gRPC, check what the OpenAI API serves beyond it (logprobs, penalties, n = 2, per-response speculative metrics,
# response_format's clear refusal on the tiny pair's word-level vocabulary), kill the drafter and let compose
# restart it, answer again, then take everything down.
#
#   bash scripts/compose_check.sh            # prints each phase's seconds; exit 0 when every check passed
#
# What it needs and makes where missing (as root, from Debian's packages): a Docker engine (docker.io; dockerd
# started with --iptables=false --storage-driver=vfs, as on these VMs) and a compose (`docker compose`, else
# Debian's docker-compose 1.29). Base images: python:3.11-slim and redis:7.4-alpine where a registry answers;
# else `debootstrap --variant=minbase bookworm` with python3.11, its venv and redis, imported as rsd-base:bookworm
# and used for both. torch: a local torch==2.13.0 wheel ($RSD_TORCH_WHEEL, else /opt/wheels/torch-2.13.0+cpu-*.whl)
# goes into deploy/wheels/ for the build when download.pytorch.org does not answer. The build uses the host's
# network, and the CA certificates the host adds (/usr/local/share/ca-certificates: an egress proxy's) are added
# to the base image. Knobs: RSD_COMPOSE_PROJECT (default rsd-check), RSD_COMPOSE_KEEP=1 leaves the cluster running,
# RSD_COMPOSE_TIMEOUT_S (wait for health, default 600).
set -euo pipefail
cd "$(dirname "$0")/.."
project=${RSD_COMPOSE_PROJECT:-rsd-check}
wait_s=${RSD_COMPOSE_TIMEOUT_S:-600}
start=$(date +%s)
last=$start
log() { echo "compose_check: $*" >&2; }
phase() {  # phase NAME: seconds since the last phase
    local now
    now=$(date +%s)
    echo "compose_check: phase $1: $((now - last)) s" >&2
    last=$now
}
as_root() { [ "$(id -u)" = 0 ] || { log "$1 is missing and installing it needs root"; exit 2; }; }
apt_install() {
    as_root "$*"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null \
        || (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null)
}

# ---------------------------------------------------------------- a Docker engine and a compose
if ! docker info >/dev/null 2>&1; then
    command -v dockerd >/dev/null || apt_install docker.io
    as_root dockerd
    log "starting dockerd (--iptables=false --storage-driver=vfs), log in /tmp/rsd-dockerd.log"
    (setsid dockerd --iptables=false --storage-driver=vfs >/tmp/rsd-dockerd.log 2>&1 &)
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || { log "dockerd did not start: see /tmp/rsd-dockerd.log"; exit 1; }
fi
if docker compose version >/dev/null 2>&1; then
    compose=(docker compose)
else
    command -v docker-compose >/dev/null || apt_install docker-compose
    # docker-compose 1.x knows no top-level `name` (the project is named by -p here anyway): a copy without it
    sed '/^name:/d' docker-compose.yml >.compose-v1.yml
    compose=(docker-compose -f .compose-v1.yml)
fi
log "engine $(docker version --format '{{.Server.Version}}'), compose: $("${compose[@]}" version --short 2>/dev/null || true)"
phase engine

# ---------------------------------------------------------------- base images
if docker image inspect python:3.11-slim >/dev/null 2>&1 \
    || timeout 60 docker pull -q python:3.11-slim >/dev/null 2>&1; then
    base=python:3.11-slim
    redis_image=redis:7.4-alpine
    docker image inspect "$redis_image" >/dev/null 2>&1 || docker pull -q "$redis_image" >/dev/null
else
    base=rsd-base:bookworm
    redis_image=$base
    if ! docker image inspect "$base" >/dev/null 2>&1; then
        command -v debootstrap >/dev/null || apt_install debootstrap
        rootfs=$(mktemp -d /tmp/rsd-rootfs.XXXXXX)
        log "no registry answers: debootstrap bookworm into $rootfs"
        packages=python3.11,python3.11-venv,python3-distutils,python3-lib2to3,python3-pip-whl,python3-setuptools-whl
        debootstrap --variant=minbase --include="$packages,redis-server,redis-tools,ca-certificates" bookworm \
            "$rootfs" http://deb.debian.org/debian >/tmp/rsd-debootstrap.log 2>&1 \
            || { log "debootstrap failed: see /tmp/rsd-debootstrap.log"; exit 1; }
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
        chmod 755 "$rootfs"  # mktemp made it 0700: as the image's /, the image's non-root user could not enter it
        tar -C "$rootfs" -c . | docker import -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            -c 'ENV LANG=C.UTF-8' - "$base" >/dev/null
        rm -rf "$rootfs"
    fi
fi
cas=(/usr/local/share/ca-certificates/*.crt)
if [ -e "${cas[0]}" ]; then  # a TLS-inspecting egress proxy: trust what the host trusts, for pip in the build
    ctx=$(mktemp -d)
    cp "${cas[@]}" "$ctx/"
    printf '%s\n' "FROM $base" "USER root" "COPY *.crt /usr/local/share/ca-certificates/" \
        "RUN update-ca-certificates >/dev/null" \
        "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt" >"$ctx/Dockerfile"
    docker build -q -t rsd-base-ca:local "$ctx" 2>/dev/null >/dev/null
    rm -rf "$ctx"
    base=rsd-base-ca:local
    log "the host's own CA certificates (/usr/local/share/ca-certificates) are trusted in the image too"
fi
log "base image $base, redis image $redis_image"
phase base-image

# ---------------------------------------------------------------- the image
index=https://download.pytorch.org/whl/cpu
if ! timeout 15 python3 -c "import urllib.request; urllib.request.urlopen('$index/torch/', timeout=10)" 2>/dev/null; then
    wheel=${RSD_TORCH_WHEEL:-$(ls /opt/wheels/torch-2.13.0+cpu-cp311-*.whl 2>/dev/null | head -1)}
    [ -n "$wheel" ] || { log "$index does not answer and no torch==2.13.0 CPU wheel is at hand (RSD_TORCH_WHEEL)"; exit 1; }
    cp -n "$wheel" deploy/wheels/
    index=https://pypi.org/simple  # torch's own dependencies; torch itself is the local wheel
    log "torch from $wheel"
fi
if [ "${RSD_COMPOSE_BUILD:-1}" = 0 ] && docker image inspect rsd:cpu >/dev/null 2>&1; then
    log "RSD_COMPOSE_BUILD=0: using the rsd:cpu image already built"
else
    docker build -q --network host -f deploy/Dockerfile --build-arg BASE_IMAGE="$base" \
        --build-arg TORCH_INDEX_URL="$index" -t rsd:cpu . 2> >(grep -v -e DEPRECATED -e buildx -e '^$' >&2) >/dev/null
fi
log "image rsd:cpu ($(docker image inspect rsd:cpu --format '{{.Size}}' | awk '{printf "%.2f GB", $1 / 1e9}'))"
phase build

# ---------------------------------------------------------------- the cluster
export RSD_REDIS_IMAGE=$redis_image
export COMPOSE_HTTP_TIMEOUT=${COMPOSE_HTTP_TIMEOUT:-900}  # vfs copies the 2 GB image for each container: minutes
down() {  # and wait until the project's containers are gone (vfs removes a 2 GB container slowly)
    "${compose[@]}" -p "$project" --profile cpu down -v --remove-orphans >/dev/null 2>&1 || true
    for _ in $(seq 300); do
        [ -z "$(docker ps -aq --filter "label=com.docker.compose.project=$project")" ] && return 0
        docker ps -aq --filter "label=com.docker.compose.project=$project" | xargs -r docker rm -f >/dev/null 2>&1 || true
        sleep 1
    done
}
[ "${RSD_COMPOSE_KEEP:-0}" = 1 ] || trap down EXIT
down
"${compose[@]}" -p "$project" --profile cpu up -d --no-build
healthy() {  # healthy SERVICE: wait until its container reports healthy
    local id state
    for _ in $(seq "$wait_s"); do
        id=$("${compose[@]}" -p "$project" --profile cpu ps -q "$1" 2>/dev/null | head -1)
        state=$([ -n "$id" ] && docker inspect -f '{{.State.Health.Status}}' "$id" 2>/dev/null || true)
        [ "$state" = healthy ] && return 0
        sleep 1
    done
    log "$1 did not become healthy in $wait_s s"
    "${compose[@]}" -p "$project" --profile cpu logs --tail 40 "$1" >&2 || true
    return 1
}
healthy gateway-cpu
phase up

[ -x .venv/bin/python ] || bash scripts/bootstrap.sh
chat() {  # one chat completion through the published OpenAI port
    .venv/bin/python - <<'PY'
from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8100/v1", api_key="none")
out = client.chat.completions.create(
    model="rsd-tiny", messages=[{"role": "user", "content": "w2 w10 w11"}], max_tokens=8, seed=3, temperature=0
)
print("compose_check: chat:", repr(out.choices[0].message.content), out.usage.completion_tokens, "tokens")
assert out.usage.completion_tokens > 0
PY
}
features() {  # what the OpenAI API serves beyond a plain chat: each check prints pass or FAIL, all of them run
    .venv/bin/python - <<'PY'
import sys

from openai import BadRequestError, OpenAI

client = OpenAI(base_url="http://127.0.0.1:8100/v1", api_key="none", max_retries=0, timeout=300)
failed = []


def chat(**kwargs):
    messages = [{"role": "user", "content": "w2 w10 w11"}]
    return client.chat.completions.create(model="rsd-tiny", messages=messages, max_tokens=8, seed=3, **kwargs)


def check(name, run):
    try:
        print(f"compose_check: {name}: pass: {run()}", file=sys.stderr)
    except Exception as e:  # any failure is this check's: reported and counted
        failed.append(name)
        print(f"compose_check: {name}: FAIL: {type(e).__name__}: {e}", file=sys.stderr)


def logprobs():  # the target's log-probabilities; at T = 0 the emitted token is the top one
    choice = chat(temperature=0, logprobs=True, top_logprobs=2).choices[0]
    tokens = choice.logprobs.content
    assert tokens and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in tokens), tokens
    assert all(t.token == t.top_logprobs[0].token for t in tokens), tokens
    top = [(x.token, round(x.logprob, 3)) for x in tokens[0].top_logprobs]
    return f"{len(tokens)} tokens, the first {tokens[0].token!r} {tokens[0].logprob:.3f}, its top 2 {top}"


def penalties():  # T = 0 completions: the tiny target loops on this prompt; a presence or frequency penalty breaks it
    def repeats(**penalty):
        out = client.completions.create(model="rsd-tiny", prompt="w2 w10 w11", max_tokens=12, temperature=0, **penalty)
        words = out.choices[0].text.split()
        return len(words) - len(set(words))

    plain, presence, frequency = repeats(), repeats(presence_penalty=2.0), repeats(frequency_penalty=2.0)
    assert presence < plain and frequency < plain, (plain, presence, frequency)
    return f"words repeated in 12: {plain} plain, {presence} with presence_penalty 2, {frequency} with frequency 2"


def n_choices():  # n = 2 from one prompt (its prefill shared)
    out = chat(temperature=1.0, n=2)
    assert sorted(c.index for c in out.choices) == [0, 1] and all(c.message.content for c in out.choices), out
    return f"2 choices {[c.message.content for c in out.choices]}, {out.usage.completion_tokens} completion tokens"


def metrics():  # vLLM's per-response metrics.speculative_decoding
    spec = chat(temperature=0).model_extra["metrics"]["speculative_decoding"]
    assert spec["num_spec_steps"] > 0, spec
    return f"mean acceptance length {spec['mean_acceptance_length']:.2f} over {spec['num_spec_steps']} steps"


def structured():  # outlines-core is in the image; the tiny pair's word-level vocabulary cannot spell JSON: a clear 400
    try:
        out = chat(temperature=0, response_format={"type": "json_object"})
    except BadRequestError as e:
        assert e.body["param"] == "response_format" and "tokenizer" in e.body["message"], e.body
        assert "outlines-core" not in e.body["message"], e.body
        return f"400 naming response_format: {e.body['message'][:90]}"
    raise AssertionError(f"answered {out.choices[0].message.content!r}, not refused")


checks = {
    "logprobs": logprobs,
    "penalties": penalties,
    "n=2": n_choices,
    "spec metrics": metrics,
    "json_object": structured,
}
for name, run in checks.items():
    check(name, run)
sys.exit(1 if failed else 0)
PY
}
generate() {  # one generation over gRPC through the published gateway port (a new session; its text first)
    .venv/bin/rsd generate --server 127.0.0.1:7100 --method rsd_s --shape 2x2 --temperature 0 --max-new-tokens 8 \
        --prompt 'w2 w10 w11' | tee /tmp/rsd-compose-generate-"$1".txt >&2
}
chat
generate before
phase answer
features
phase features

"${compose[@]}" -p "$project" --profile cpu kill drafter-cpu >/dev/null
"${compose[@]}" -p "$project" --profile cpu up -d --no-build drafter-cpu
healthy drafter-cpu
generate after
cmp -s <(head -1 /tmp/rsd-compose-generate-before.txt) <(head -1 /tmp/rsd-compose-generate-after.txt) \
    || { log "the restarted drafter answered differently at T = 0"; exit 1; }
chat
phase restart
log "every check passed in $(($(date +%s) - start)) s"
