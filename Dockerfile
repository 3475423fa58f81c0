# syntax=docker/dockerfile:1
# compactor: multi-stage build (Rust toolchain → slim Debian runtime).

FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
# Dependencies first, so source edits do not re-fetch crates. Cargo reads
# every target the manifest names before it fetches: the benches it lists
# come along, and so does every member of the workspace (the engine crate's
# manifest; scripts/check_dockerfile.py runs these steps in the tests).
COPY Cargo.toml Cargo.lock ./
COPY crates/compactor-engine/Cargo.toml ./crates/compactor-engine/
COPY benches ./benches
RUN mkdir -p src crates/compactor-engine/src && echo 'fn main() {}' > src/main.rs \
    && touch src/lib.rs crates/compactor-engine/src/lib.rs \
    && cargo fetch --locked
COPY . .
# `--build-arg PGO=1`: the profile-guided build of scripts/build_pgo.sh (an
# instrumented build trained on the benchmarks' load through the mock
# upstream, then the optimised build; README's load figures give both
# builds). Two full builds and a minute of training: about twice the time of
# the default, which is the plain release build. The training needs wrk
# and python3 (the benchmark bodies), this stage only.
ARG PGO=0
RUN if [ "$PGO" = 1 ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends wrk python3 \
        && bash scripts/build_pgo.sh \
        && mkdir -p target/release \
        && cp target/pgo/perf/compactor target/release/compactor; \
    else \
        cargo build --release --locked --bin compactor; \
    fi \
    && strip target/release/compactor

FROM debian:bookworm-slim
# ca-certificates: native roots for https upstreams (Mozilla roots are built in too).
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home compactor \
    && mkdir -p /var/lib/compactor && chown compactor /var/lib/compactor
COPY --from=build /src/target/release/compactor /usr/local/bin/compactor
COPY proxy.toml /etc/compactor/proxy.toml
USER compactor
# The store's file (records, learned windows, the keyer secret): the user has
# no home for the default under ~/.local/state, and a volume keeps it across
# containers, so a restart does not pay for the conversations' summaries again.
ENV COMPACTOR_LISTEN=0.0.0.0:4000 \
    COMPACTOR_STORE_PATH=/var/lib/compactor/state.log \
    RUST_LOG=compactor=info
VOLUME /var/lib/compactor
EXPOSE 4000
ENTRYPOINT ["/usr/local/bin/compactor", "--config", "/etc/compactor/proxy.toml"]
