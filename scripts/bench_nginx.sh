# nginx as the benchmarks run it beside compactor, sourced by
# scripts/bench_load.sh and scripts/bench_instructions.sh so both measure
# the same proxy: one worker, no response or request buffering, a
# keep-alive upstream pool, no access log (NGINX_ACCESS_LOG=FILE: one line a
# request in FILE, nginx's default format and unbuffered writes, as its own
# default configuration logs; compactor logs a line a request by default).

# Installed from the distribution's packages when missing (the tests do not
# need it); NGINX is its path.
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || apt-get install -y nginx-light >/dev/null \
  || apt-get install -y nginx >/dev/null
NGINX=$(command -v nginx || echo /usr/sbin/nginx)

# free_port: a TCP port on 127.0.0.1 nobody listens on now.
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# write_nginx_conf DIR UPSTREAM LISTEN ERROR_LOG [DIRECTIVE...]: DIR/nginx.conf
# proxying LISTEN to UPSTREAM (host:port); each DIRECTIVE is a main-context
# line added at the top (`master_process off;` runs it as one process).
write_nginx_conf() {
  local dir="$1" upstream="$2" listen="$3" errlog="$4"
  shift 4
  mkdir -p "$dir"
  {
    for d in "$@"; do echo "$d"; done
    cat <<CONF
worker_processes 1;
daemon off;
pid $PWD/$dir/nginx.pid;
error_log $errlog warn;
events { worker_connections 4096; }
http {
  access_log ${NGINX_ACCESS_LOG:-off};
  client_body_temp_path $PWD/$dir/body;
  proxy_temp_path $PWD/$dir/proxy;
  fastcgi_temp_path $PWD/$dir/fastcgi;
  uwsgi_temp_path $PWD/$dir/uwsgi;
  scgi_temp_path $PWD/$dir/scgi;
  upstream mock {
    server $upstream;
    keepalive 128;
  }
  server {
    listen $listen;
    location / {
      proxy_pass http://mock;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      # Buffered, nginx sends a request of a few KB upstream in two writes
      # and waits out the delayed ACK: 44 ms a request for the 20 KB bodies.
      proxy_request_buffering off;
    }
  }
}
CONF
  } >"$dir/nginx.conf"
}
