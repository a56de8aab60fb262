#!/usr/bin/env bash
# poll.sh SECS: wait up to SECS for /tmp/r28b/DONE; packs /tmp/r28b into $OUT/r28b.tgz.
R=/tmp/r28b; end=$((SECONDS+$1))
while [ $SECONDS -lt $end ] && [ ! -f $R/DONE ]; do sleep 5; done
echo "poll: $(date +%T) after $SECONDS s; DONE: $([ -f $R/DONE ] && echo yes || echo no)"
tail -n 12 $R/*.log
tail -c 1500 $R/session.out 2>/dev/null
tar czf $OUT/r28b.tgz -C /tmp r28b && ls -la $OUT
