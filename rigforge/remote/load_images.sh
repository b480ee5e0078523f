#!/bin/sh
# rigforge images load, on the rig (roles/images.py, roles/operations/images.py): put saved images into the rig's
# Docker at their locked digests. Docker's `docker load` drops the repository digest (moby#22011), so:
#   a temporary Distribution registry on 127.0.0.1:PORT (storage in WORK), every blob and manifest of the saved OCI
#   layout pushed into it byte for byte (the registry checks each digest), the registry listed in daemon.json's
#   registry-mirrors (the daemon.json text the controller merged, the user's entries kept) and `systemctl reload
#   docker` (SIGHUP; registry-mirrors is reloadable), `docker pull REF@DIGEST`: a Docker Hub image comes through
#   the mirror, and Docker records REF@sha256:... in RepoDigests. Then daemon.json is put back as it was, docker
#   reloaded again, the registry stopped and WORK removed: on success, on failure, and on INT/TERM/HUP (a trap).
#   A run that was killed outright is repaired by `load_images.sh repair WORK DAEMON_JSON` (the next run's first
#   step): the same clean-up, from what WORK records.
#
# load_images.sh load WORK LAYOUT PORT DAEMON_JSON PLAN
#   WORK: the work dir (created; removed at the end), LAYOUT: the OCI layout (blobs/sha256/<hex>),
#   PORT: a free port on 127.0.0.1, DAEMON_JSON: Docker's daemon.json, PLAN: lines, in order,
#     blob REPO DIGEST | manifest REPO DIGEST MEDIA_TYPE | pull REF@DIGEST
#   WORK/daemon.json.mirrored: daemon.json with the mirror added, WORK/daemon.json.cleared: daemon.json with the
#   user's own registry-mirrors set explicitly (both merged and uploaded by the controller before this runs).
# load_images.sh repair WORK DAEMON_JSON
set -eu
# When the controller goes (killed, link dropped), output has nowhere to go: with SIGPIPE ignored a write fails
# instead of killing the shell before its trap ran; `say` never fails, so the clean-up always runs to the end.
trap '' PIPE

say() { echo "rigforge images: $*" 2>/dev/null || true; }

reload_docker() {
  systemctl reload docker.service || say "WARNING: systemctl reload docker failed"
}

# Is pid $1 still the process WORK recorded (its command line holds $2)? Not another one after a reboot.
ours() {
  [ -n "$1" ] && tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -qF -- "$2"
}

# Put daemon.json back as it was (WORK records it), reload docker, stop the registry, remove WORK. Every step is
# allowed to fail (said, not fatal), so that the ones after it still run.
clean_up() {
  work=$1 daemon_json=$2
  old=$(cat "$work/script.pid" 2>/dev/null || true)
  if [ "$old" != "$$" ] && ours "$old" load_images.sh; then
    # a run still going after its controller was killed: its own trap cleans up; wait for it
    if kill "$old" 2>/dev/null; then
      i=0
      while kill -0 "$old" 2>/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
    fi
  fi
  if [ -e "$work/daemon.json.orig" ] || [ -e "$work/daemon.json.absent" ]; then
    # A reload leaves an option that daemon.json no longer sets as it was, so removing the mirror from the file is
    # not enough: reload with the user's own registry-mirrors set explicitly (daemon.json.cleared, merged by the
    # controller), then put the user's file back byte for byte (what a later restart reads: the same mirrors).
    port=$(cat "$work/port" 2>/dev/null || echo none)
    if cp "$work/daemon.json.cleared" "$daemon_json.rigforge-new" 2>/dev/null; then
      chmod 644 "$daemon_json.rigforge-new" && mv -f "$daemon_json.rigforge-new" "$daemon_json" && reload_docker
      i=0
      while docker info --format '{{json .RegistryConfig.Mirrors}}' 2>/dev/null | grep -qF "127.0.0.1:$port/"; do
        i=$((i + 1))
        [ $i -le 100 ] || { say "WARNING: docker still lists the mirror 127.0.0.1:$port; restart docker"; break; }
        sleep 0.1
      done
    fi
    if [ -e "$work/daemon.json.orig" ]; then
      mv -f "$work/daemon.json.orig" "$daemon_json" || say "WARNING: could not put $daemon_json back"
    else
      rm -f "$daemon_json" "$work/daemon.json.absent" || say "WARNING: could not remove $daemon_json"
    fi
    say "daemon.json restored; docker's registry-mirrors are the user's again"
  fi
  pid=$(cat "$work/registry.pid" 2>/dev/null || true)
  if ours "$pid" "docker-registry serve $work/config.yml"; then
    if kill "$pid" 2>/dev/null; then
      i=0
      while kill -0 "$pid" 2>/dev/null && [ $i -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
      kill -9 "$pid" 2>/dev/null || true
      say "temporary registry stopped"
    fi
  fi
  rm -rf "$work" || say "WARNING: could not remove $work"
}

if [ "$1" = repair ]; then
  [ -d "$2" ] || exit 0
  say "repairing what an interrupted load left in $2"
  clean_up "$2" "$3"
  exit 0
fi

work=$2 layout=$3 port=$4 daemon_json=$5 plan=$6
url="http://127.0.0.1:$port"

on_exit() {
  rc=$?
  trap - EXIT INT TERM HUP
  clean_up "$work" "$daemon_json"
  [ $rc -eq 0 ] || say "load failed (exit $rc); the rig is as before"
  exit $rc
}
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

mkdir -p "$work/storage"
echo $$ >"$work/script.pid"
echo "$port" >"$work/port"
cat >"$work/config.yml" <<EOF
version: 0.1
log: {level: warn}
storage: {filesystem: {rootdirectory: $work/storage}}
http: {addr: '127.0.0.1:$port'}
EOF
docker-registry serve "$work/config.yml" >"$work/registry.log" 2>&1 &
echo $! >"$work/registry.pid"
i=0
until curl -fs -o /dev/null "$url/v2/"; do
  i=$((i + 1))
  if [ $i -gt 100 ] || ! kill -0 "$(cat "$work/registry.pid")" 2>/dev/null; then
    say "the temporary registry did not start on $url:"; tail -5 "$work/registry.log" >&2; exit 1
  fi
  sleep 0.1
done
say "temporary registry on $url"

pushed=0
while read -r kind repo digest extra; do
  case "$kind" in
  blob)
    file="$layout/blobs/sha256/${digest#sha256:}"
    location=$(curl -fsS -X POST -D - -o /dev/null "$url/v2/$repo/blobs/uploads/" | tr -d '\r' |
      sed -n 's/^[Ll]ocation: *//p')
    case "$location" in http*) ;; *) location="$url$location" ;; esac
    case "$location" in *\?*) sep='&' ;; *) sep='?' ;; esac
    curl -fsS -X PUT -H 'Content-Type: application/octet-stream' -T "$file" "$location${sep}digest=$digest" \
      -o /dev/null
    pushed=$((pushed + 1))
    ;;
  manifest)
    curl -fsS -X PUT -H "Content-Type: $extra" --data-binary "@$layout/blobs/sha256/${digest#sha256:}" \
      "$url/v2/$repo/manifests/$digest" -o /dev/null
    say "manifest $repo@$digest in the temporary registry ($pushed blobs so far)"
    ;;
  pull) ;;
  *) say "unknown plan line: $kind"; exit 2 ;;
  esac
done <"$plan"

if [ -e "$daemon_json" ]; then cp -p "$daemon_json" "$work/daemon.json.orig"; else : >"$work/daemon.json.absent"; fi
mkdir -p "$(dirname "$daemon_json")"
cp "$work/daemon.json.mirrored" "$daemon_json.rigforge-new" && chmod 644 "$daemon_json.rigforge-new"
mv -f "$daemon_json.rigforge-new" "$daemon_json"
reload_docker
i=0
until docker info --format '{{json .RegistryConfig.Mirrors}}' 2>/dev/null | grep -qF "127.0.0.1:$port"; do
  i=$((i + 1))
  [ $i -le 100 ] || { say "docker did not take the mirror $url after a reload"; exit 1; }
  sleep 0.1
done
say "docker pulls Docker Hub images through $url"

while read -r kind image _; do
  [ "$kind" = pull ] || continue
  docker pull "$image"
  docker image inspect "$image" >/dev/null
  say "$image: held by docker"
done <"$plan"
