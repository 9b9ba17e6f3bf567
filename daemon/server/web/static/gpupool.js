// Keeps a dashboard page live without reloading it, and the only script the pages run
// (the Content-Security-Policy allows no other). The server renders every piece of HTML,
// escaped; this puts the page's live block where it was, and appends a job's log as text.
"use strict";
(function () {
  const live = document.getElementById("live");
  if (live && live.dataset.live && window.EventSource) {
    const pageEvents = new EventSource(live.dataset.live);
    pageEvents.onmessage = function (event) {
      live.innerHTML = event.data;
    };
  }
  const log = document.getElementById("log");
  const logState = document.getElementById("log-state");
  if (log && log.dataset.log && window.EventSource) {
    const logEvents = new EventSource(log.dataset.log);
    logEvents.addEventListener("log", function (event) {
      const atBottom = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
      log.append(JSON.parse(event.data));
      if (atBottom) log.scrollTop = log.scrollHeight;
    });
    const finish = function (text) {
      logEvents.close();
      if (logState) logState.textContent = text;
    };
    logEvents.addEventListener("end", function (event) {
      finish("the log ended: " + JSON.parse(event.data));
    });
    logEvents.addEventListener("failed", function (event) {
      finish(JSON.parse(event.data));
    });
  }
})();
