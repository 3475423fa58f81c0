# syntax=docker/dockerfile:1
# compactor: multi-stage build (Rust toolchain → slim Debian runtime).

FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
# Dependencies first, so source edits do not re-fetch crates.
COPY Cargo.toml Cargo.lock ./
RUN mkdir -p src && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \
    && cargo fetch --locked
COPY . .
RUN cargo build --release --locked --bin compactor \
    && strip target/release/compactor

FROM debian:bookworm-slim
# ca-certificates: native roots for https upstreams (Mozilla roots are built in too).
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home compactor
COPY --from=build /src/target/release/compactor /usr/local/bin/compactor
COPY proxy.toml /etc/compactor/proxy.toml
USER compactor
ENV COMPACTOR_LISTEN=0.0.0.0:4000 \
    RUST_LOG=compactor=info
EXPOSE 4000
ENTRYPOINT ["/usr/local/bin/compactor", "--config", "/etc/compactor/proxy.toml"]
