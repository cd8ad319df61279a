// Draws the latency and crash-rate charts of a page from the series the server embedded
// (the same document as /api/v1/.../series). No data is fetched: the page is complete.
(function () {
  "use strict";
  var holder = document.getElementById("series-data");
  if (!holder || typeof Plotly === "undefined") { return; }
  var doc = JSON.parse(holder.textContent);

  // Plotly reads a few HTML tags in text (<a href>, <b>): device-reported attributes
  // (device_model, soc) are shown as written, never as markup.
  function plain(text) {
    return String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  }

  function label(s) {
    var l = s.labels;
    if (l.cohort) { return plain(l.cohort); }
    // The quieter series, merged by the server into one (quantiles of all they hold).
    if (l.other) {
      var classes = l.device_classes;
      if (!classes) { return "other (" + l.other + " series)"; }
      return "other (" + (classes === l.other ? classes + " classes" : l.other + " series of " + classes + " classes") + ")";
    }
    var cls = Object.keys(l.device_class || {}).sort().map(function (k) {
      return k + "=" + (l.device_class[k] || "?");
    }).join(",");
    return plain(l.variant + " " + (l.config || "-") + " " + cls);
  }

  function traces(field, dash) {
    return doc.series.map(function (s) {
      return {
        x: s.points.map(function (p) { return p.at; }),
        y: s.points.map(function (p) { return p[field]; }),
        name: label(s) + (dash ? " " + field.replace("_us", "") : ""),
        mode: "lines+markers",
        line: dash ? { dash: dash } : {},
        connectgaps: false
      };
    });
  }

  var layout = function (title, unit) {
    return {
      title: { text: title }, margin: { t: 40, l: 60, r: 20, b: 40 },
      yaxis: { title: { text: unit }, rangemode: "tozero" }, legend: { orientation: "h" }
    };
  };
  var config = { displaylogo: false, responsive: true };
  var latency = document.getElementById("chart-latency");
  if (latency) {
    var quantiles = ["p50_us", "p95_us", "p99_us"];
    var dashes = { p50_us: "dot", p95_us: "solid", p99_us: "dash" };
    var lines = [];
    quantiles.forEach(function (q) { lines = lines.concat(traces(q, dashes[q])); });
    var n = doc.series.length;
    if (n <= 3) {
      Plotly.newPlot(latency, lines, layout("Latency p50 (dotted) / p95 / p99 (dashed)", "µs"), config);
    } else {
      // Many configs and classes: one quantile at a time, chosen from a menu.
      var visible = function (q) {
        return lines.map(function (_, i) { return quantiles[Math.floor(i / n)] === q; });
      };
      lines.forEach(function (t, i) { t.visible = quantiles[Math.floor(i / n)] === "p95_us"; });
      var chosen = layout("Latency by backend config and device class", "µs");
      chosen.updatemenus = [{
        x: 0, y: 1.15, xanchor: "left", active: 1,
        buttons: quantiles.map(function (q) {
          return { label: q.replace("_us", ""), method: "restyle", args: [{ visible: visible(q) }] };
        })
      }];
      Plotly.newPlot(latency, lines, chosen, config);
    }
  }
  var crash = document.getElementById("chart-crash");
  if (crash) {
    Plotly.newPlot(crash, traces("crash_rate"), layout("Crash rate", "crashes per inference"), config);
  }
  // A language model's own figures: decode speed and time to first token.
  var llm = doc.series.some(function (s) {
    return s.points.some(function (p) { return p.decode_tps !== undefined; });
  });
  [["chart-decode", "decode_tps", "Decode speed (median generation)", "tokens/s"],
   ["chart-ttft", "ttft_p95_ms", "Time to first token p95", "ms"]].forEach(function (c) {
    var div = document.getElementById(c[0]);
    if (!div) { return; }
    if (!llm) { div.remove(); return; }
    Plotly.newPlot(div, traces(c[1]), layout(c[2], c[3]), config);
  });
}());
