bash scripts/gpu/envoy_run.sh /tmp/out/run18/envoy
