#!/usr/bin/env bash
# poll.sh SECS: wait up to SECS for /tmp/r26/DONE; packs /tmp/r26 into $OUT/r26.tgz.
R=/tmp/r26; end=$((SECONDS+$1))
while [ $SECONDS -lt $end ] && [ ! -f $R/DONE ]; do sleep 5; done
echo "poll: $(date +%T) after $SECONDS s; DONE: $([ -f $R/DONE ] && echo yes || echo no)"
tail -n 40 $R/session.log
tail -c 1500 $R/session.out 2>/dev/null
tar czf $OUT/r26.tgz -C /tmp r26 && ls -la $OUT
