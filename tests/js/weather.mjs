// The Vercel AI SDK's generateText with one tool against pdserve (tests/test_agents_sdk.py):
// node weather.mjs BASE_URL chat|responses PROMPT prints the tool's calls, the SDK's parsed calls,
// each step's finish reason and the final text as one JSON line. The packages declare node >= 22
// and run as used here on node 20 (npm only warns).
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, tool, stepCountIs } from "ai";
import { z } from "zod";
const [baseURL, api, prompt] = process.argv.slice(2);
const provider = createOpenAI({ baseURL, apiKey: "none" });
const calls = [];
const getWeather = tool({
  description: "Get the current weather in a given city.",
  inputSchema: z.object({ city: z.string() }),
  execute: async ({ city }) => { calls.push(city); return `sunny, 21 C in ${city}`; },
});
const model = api === "chat" ? provider.chat("SmolLM2-135M-Instruct") : provider.responses("SmolLM2-135M-Instruct");
const result = await generateText({ model, prompt, tools: { get_weather: getWeather }, temperature: 0,
  maxOutputTokens: 64, stopWhen: stepCountIs(3), maxRetries: 0 });
console.log(JSON.stringify({ calls, toolCalls: result.steps.flatMap(s => s.toolCalls.map(c => ({ name: c.toolName, input: c.input }))),
  finish: result.steps.map(s => s.finishReason), text: result.text }));
