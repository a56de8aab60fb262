#!/usr/bin/env bash
# poll.sh SECS: wait up to SECS for /tmp/r30/DONE; packs /tmp/r30 into $OUT/r30.tgz.
R=/tmp/r30; end=$((SECONDS+$1))
while [ $SECONDS -lt $end ] && [ ! -f $R/DONE ]; do sleep 5; done
echo "poll: $(date +%T) after $SECONDS s; DONE: $([ -f $R/DONE ] && echo yes || echo no)"
tail -n 40 $R/session.log
tail -c 1500 $R/session.out 2>/dev/null
tar czf $OUT/r30.tgz -C /tmp r30 && ls -la $OUT
