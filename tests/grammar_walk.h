// A random walk through a grammar (model/json_schema.h), for the structured-output tests.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "model/json_schema.h"

namespace kvq {

// A random document of the grammar: bytes drawn among those that can come next, ending when the
// state accepts (with a probability that grows with length). Checks that no state is a dead end.
inline std::string random_walk(const std::shared_ptr<const Grammar>& g, std::mt19937& rng, bool* finished) {
  GrammarState s(g);
  std::string out;
  *finished = false;
  for (int len = 0; len < 600; ++len) {
    if (s.accepting() && (s.done() || std::uniform_int_distribution<int>(0, 99)(rng) < 5 + len / 10)) {
      *finished = true;
      return out;
    }
    std::vector<unsigned char> next;
    for (int c = 0; c < 256; ++c) {
      GrammarState t(nullptr);
      if (s.step(static_cast<unsigned char>(c), t)) next.push_back(static_cast<unsigned char>(c));
    }
    EXPECT_FALSE(next.empty()) << "dead end after '" << out << "'";
    if (next.empty()) return out;
    // Past 200 bytes, prefer what closes: brackets, quotes, and the digits and letters of short
    // words, so that most walks end (and a backslash, which a pattern may need before a quote).
    unsigned char c = next[std::uniform_int_distribution<size_t>(0, next.size() - 1)(rng)];
    if (len > 200)
      for (unsigned char pref : std::string("\"\\}]el0"))
        if (std::find(next.begin(), next.end(), pref) != next.end()) {
          c = pref;
          break;
        }
    EXPECT_TRUE(s.feed(c));
    out += char(c);
  }
  return out;
}

}  // namespace kvq
