#!/usr/bin/env bash
# poll.sh SECS: wait up to SECS for /tmp/r28/DONE; packs /tmp/r28 into $OUT/r28.tgz.
R=/tmp/r28; end=$((SECONDS+$1))
while [ $SECONDS -lt $end ] && [ ! -f $R/DONE ]; do sleep 5; done
echo "poll: $(date +%T) after $SECONDS s; DONE: $([ -f $R/DONE ] && echo yes || echo no)"
tail -n 40 $R/session.log
tail -c 1500 $R/session.out 2>/dev/null
tar czf $OUT/r28.tgz -C /tmp r28 && ls -la $OUT
